# PyTorch's GEMMs (cuBLAS through F.linear and its backward) at the shapes `gpu-timing` times
# ours: x [N, cin] bf16, W [cout, cin], bias; forward y = x W^T + b; backward dX = dY W,
# dW = dY^T X, db = sum(dY) — the same FLOP convention (2 N cin cout per GEMM). Usage:
#   python3 dev/gemm_timing.py N C     (124M: 16384 768; 1.5B: 8192 1600)
import sys, torch
import torch.nn.functional as F
N, C = int(sys.argv[1]), int(sys.argv[2])
V = 50304
from torch_timed import timed  # (this script's directory is on sys.path)
print(f"torch {torch.__version__} cuBLAS GEMMs, N={N} C={C}")
bf = dict(device="cuda", dtype=torch.bfloat16)
for name, cin, cout in [("qkv", C, 3 * C), ("attn proj", C, C), ("fc", C, 4 * C), ("fc2", 4 * C, C), ("lm head padded", C, V)]:
    x, w, b = torch.randn(N, cin, **bf), torch.randn(cout, cin, **bf) * 0.02, torch.zeros(cout, **bf)
    dy = torch.randn(N, cout, **bf)
    flop = 2.0 * N * cin * cout
    bias = None if name.startswith("lm") else b
    f = timed(lambda: F.linear(x, w, bias))
    def bwd():
        dx = dy @ w
        dw = dy.t() @ x
        if bias is not None:
            db = dy.sum(0)
    g = timed(bwd)
    print(f"  matmul_fwd {name} ({cin}->{cout})  {f:.3f} ms  {flop / f / 1e9:6.1f} TFLOP/s    "
          f"bwd {g:.3f} ms  {2 * flop / g / 1e9:6.1f} TFLOP/s")
