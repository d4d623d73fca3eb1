# What bandwidth a plain device copy and PyTorch's bf16 -> e4m3 cast reach on this GPU (the
# ceiling our cast kernels are read against).
import torch
from torch_timed import timed
x = torch.randn(8192 * 6400, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
q = torch.empty(x.numel(), device="cuda", dtype=torch.float8_e4m3fn)
for name, f, nbytes in [("copy bf16 104MB->104MB", lambda: y.copy_(x), 4 * x.numel()),
                        ("cast bf16->e4m3 104MB->52MB", lambda: q.copy_(x), 3 * x.numel())]:
    ms = timed(f)
    print(f"{name}: {ms:.4f} ms, {nbytes / ms / 1e9:.2f} TB/s")
