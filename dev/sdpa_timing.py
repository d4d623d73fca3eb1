# PyTorch's SDPA (flash / cuDNN backends, whichever PyTorch picks) at the shapes
# `gpu-timing attention [T]` uses: causal, B=4, NH=16, head sizes 64/80/96/128, bf16; or
# another batch and head count: `sdpa_timing.py T B NH [NKV]` (GPT-2 124M: 1024 16 12).
# With NKV < NH, grouped-query attention: NH query heads share NKV key/value heads
# (`enable_gqa=True`, PyTorch >= 2.5: K and V stay [B, NKV, T, HS]; Llama 3.2 1B:
# 2048 8 32 8, Llama 3.1 8B: 4096 1 32 8), as `gpu-timing attention T B NH NKV`.
# Prints one line per head size with forward and backward TFLOP/s (same FLOP convention:
# causal = half of the T x T products per query head; backward counted as 2.5 x forward).
import sys, torch, torch.nn.functional as F
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
B = int(sys.argv[2]) if len(sys.argv) > 2 else 4
NH = int(sys.argv[3]) if len(sys.argv) > 3 else 16
NKV = int(sys.argv[4]) if len(sys.argv) > 4 else NH
assert NH % NKV == 0, f"NKV = {NKV} must divide NH = {NH}"
from torch_timed import timed  # (this script's directory is on sys.path)
gqa = NKV != NH
heads = f"{B*NH} query heads sharing {B*NKV} key/value heads (enable_gqa)" if gqa else f"{B*NH} heads"
print(f"SDPA causal, B x NH = {heads}, T = {T}, torch {torch.__version__}")
kw = {"enable_gqa": True} if gqa else {}
for hs in (64, 80, 96, 128):
    q = torch.randn(B, NH, T, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, NKV, T, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    flop = 2 * 2 * B * NH * T * T * hs / 2
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    g = torch.randn_like(out)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw))
    def fb():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        torch.autograd.grad(o, (q, k, v), g)
    both = timed(fb)
    bwd = both - fwd
    print(f"  SDPA HS{hs}: fwd {fwd:.3f} ms {flop / fwd / 1e9:.1f} TFLOP/s, bwd {bwd:.3f} ms {2.5 * flop / bwd / 1e9:.1f} TFLOP/s")
