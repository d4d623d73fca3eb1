# Where PyTorch's step time goes, per kernel: runs the shared reference (fsdp_gpt2.py) on one
# GPU under torch.profiler and prints, per training step, the CUDA time of its kernels grouped
# (attention forward/backward, GEMMs, Triton-fused element-wise, optimizer, the rest) and the
# top kernels. For comparing with `gpu-timing` (ours, per op) at the same shapes:
#
#   python3 scripts/torch_profile.py .carry/fsdp_gpt2.py --mode single --compile --layers 12 \
#       --embd 768 --heads 12 --batch 16 --warmup 3 --steps 10
#
# Every step the script runs (warm-up included) is profiled; the totals are divided by that
# count, so the first compiled step's one-off kernels (few) are spread over the others.
import re, runpy, sys
import torch
from torch.profiler import ProfilerActivity, profile

ref, args = sys.argv[1], sys.argv[2:]
steps = sum(int(args[i + 1]) for i, x in enumerate(args) if x in ("--warmup", "--steps"))
sys.argv = [ref] + args
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    runpy.run_path(ref, run_name="__main__")
groups = [
    ("attention forward", r"flash.*fwd|fmha.*fwd|attention.*fwd|cudnn.*fprop|sdpa.*fwd"),
    ("attention backward", r"flash.*bwd|fmha.*bwd|attention.*bwd|cudnn.*dgrad|cudnn.*bprop|sdpa.*bwd|dot_do_o"),
    ("GEMMs (cuBLAS/CUTLASS)", r"gemm|xmma|cutlass|nvjet|sm90_|cublas"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("Triton (fused element-wise, norms, loss)", r"^triton"),
]
rows = {}
for e in prof.key_averages():
    t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    if t > 0 and e.key not in ("", None):
        rows[e.key] = rows.get(e.key, 0) + t
total = sum(rows.values())
by = {}
for k, t in rows.items():
    g = next((n for n, rx in groups if re.search(rx, k, re.I)), "other")
    by[g] = by.get(g, 0) + t
print(f"\nPyTorch kernels per step ({steps} steps profiled): {total / steps / 1e3:.2f} ms of GPU time")
for g, t in sorted(by.items(), key=lambda x: -x[1]):
    print(f"  {g:45s} {t / steps / 1e3:8.3f} ms  {100 * t / total:5.1f}%")
print("\ntop kernels (ms per step):")
for k, t in sorted(rows.items(), key=lambda x: -x[1])[:25]:
    print(f"  {t / steps / 1e3:8.3f}  {k[:110]}")
