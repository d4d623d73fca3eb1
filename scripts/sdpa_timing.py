# PyTorch's SDPA (flash / cuDNN backends, whichever PyTorch picks) at the shapes
# `gpu-timing attention [T]` uses: causal, B=4, NH=16, head sizes 64/80/96/128, bf16; or
# another batch and head count: `sdpa_timing.py T B NH` (GPT-2 124M: 1024 16 12).
# Prints one line per head size with forward and backward TFLOP/s (same FLOP convention:
# causal = half of the T x T products; backward counted as 2.5 x forward).
import sys, torch, torch.nn.functional as F
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
B = int(sys.argv[2]) if len(sys.argv) > 2 else 4
NH = int(sys.argv[3]) if len(sys.argv) > 3 else 16
from torch_timed import timed  # (this script's directory is on sys.path)
print(f"SDPA causal, B x NH = {B*NH} heads, T = {T}, torch {torch.__version__}")
for hs in (64, 80, 96, 128):
    q, k, v = (torch.randn(B, NH, T, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flop = 2 * 2 * B * NH * T * T * hs / 2
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(out)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    def fb():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), g)
    both = timed(fb)
    bwd = both - fwd
    print(f"  SDPA HS{hs}: fwd {fwd:.3f} ms {flop / fwd / 1e9:.1f} TFLOP/s, bwd {bwd:.3f} ms {2.5 * flop / bwd / 1e9:.1f} TFLOP/s")
