# PyTorch's FP8 GEMMs (torch._scaled_mm: cuBLASLt, per-tensor scales) beside its bf16 ones at
# the linear layers' shapes `gpu-timing fp8` times ours (GPT-2 1.5B, Llama-3-8B; N rows):
# forward Y = X W^T (e4m3 x e4m3), dX = dY W (e5m2 x e4m3), dW = dY^T X (e5m2 x e4m3; fp32 out,
# as ours accumulates into the fp32 gradient), each with promoted sums (use_fast_accum=False,
# shardtrain's default) and with fast accumulation. The operands are laid out as _scaled_mm
# wants them (A row-major, B column-major: the transposed copies our casts make). Same FLOP
# convention as gpu-timing (2 N cin cout per GEMM). Usage: python3 dev/scaled_mm_timing.py [N]
import sys
import torch
from torch_timed import timed  # (this script's directory is on sys.path)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
bf = dict(device="cuda", dtype=torch.bfloat16)
one = torch.ones((), device="cuda", dtype=torch.float32)
SHAPES = {
    "GPT-2 1.5B": [("qkv", 1600, 4800), ("proj", 1600, 1600), ("fc", 1600, 6400), ("fc2", 6400, 1600)],
    "Llama-3-8B": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
}
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: torch._scaled_mm beside bf16 mm, N={N}")
for model, layers in SHAPES.items():
    tot = {"bf16": 0.0, "fp8": 0.0, "fp8 fast": 0.0}
    print(f"\n{model}")
    for name, cin, cout in layers:
        flop = 2.0 * N * cin * cout
        x, w, dy = torch.randn(N, cin, **bf), torch.randn(cout, cin, **bf) * 0.02, torch.randn(N, cout, **bf)
        # FP8 copies in the layouts cuBLASLt's TN GEMMs read: row-major A, column-major B.
        x8, w8, dy8 = x.to(E4), w.to(E4), dy.to(E5)
        wt8, xt8, dyt8 = w.t().contiguous().to(E4), x.t().contiguous().to(E4), dy.t().contiguous().to(E5)
        gemms = {
            "fwd": (lambda: x @ w.t(), lambda fast: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)),
            "dgrad": (lambda: dy @ w, lambda fast: torch._scaled_mm(dy8, wt8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)),
            "wgrad": (lambda: dy.t() @ x, lambda fast: torch._scaled_mm(dyt8, xt8.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast)),
        }
        for g, (b16, f8) in gemms.items():
            tb, tf, tff = timed(b16), timed(lambda: f8(False)), timed(lambda: f8(True))
            tot["bf16"] += tb
            tot["fp8"] += tf
            tot["fp8 fast"] += tff
            t = lambda ms: f"{ms:.3f} ms {flop / ms / 1e9:6.1f} TFLOP/s"
            print(f"  {name:8} {g:5} {cin:>5}->{cout:<5}  bf16 {t(tb)}   fp8 {t(tf)} ({tb / tf:.2f}x)   fp8 fast accum {t(tff)} ({tb / tff:.2f}x)")
    print(f"  {model}: the twelve GEMMs bf16 {tot['bf16']:.3f} ms, fp8 {tot['fp8']:.3f} ms ({tot['bf16'] / tot['fp8']:.2f}x), "
          f"fp8 fast accum {tot['fp8 fast']:.3f} ms ({tot['bf16'] / tot['fp8 fast']:.2f}x)")
