# Could the FP8 backward hide its casts behind its GEMMs? At GPT-2 1.5B's shapes (N rows), each
# layer's dgrad GEMM (torch._scaled_mm: e5m2 dY x e4m3 W^T, the same cuBLASLt) is timed alone,
# then the bandwidth-bound work the backward does beside it (the layer input's transposed e4m3
# copy for the weight gradient: read bf16 X, write X^T) alone, then both at once on two CUDA
# streams. "hidden" is the share of the cast's time the concurrent pair saves against running
# them one after the other: 100% = the cast is free beside the GEMM, 0% = no overlap. A probe
# for the lever BENCHMARKS.md run 22 names (a second stream in the FP8 backward), before
# building it. Usage: python3 dev/overlap_probe.py [N]
import sys
import torch
from torch_timed import timed  # (this script's directory is on sys.path)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
bf = dict(device="cuda", dtype=torch.bfloat16)
one = torch.ones((), device="cuda", dtype=torch.float32)
LAYERS = [("qkv", 1600, 4800), ("proj", 1600, 1600), ("fc", 1600, 6400), ("fc2", 6400, 1600)]
side = torch.cuda.Stream()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: dgrad GEMM beside the input's transposing cast, N={N}")
tot = [0.0, 0.0, 0.0]
for name, cin, cout in LAYERS:
    x, w, dy = torch.randn(N, cin, **bf), torch.randn(cout, cin, **bf) * 0.02, torch.randn(N, cout, **bf)
    wt8, dy8 = w.t().contiguous().to(E4), dy.to(E5)
    xt8 = torch.empty(cin, N, device="cuda", dtype=E4)

    def gemm():
        return torch._scaled_mm(dy8, wt8.t(), one, one, out_dtype=torch.bfloat16)

    def cast():
        xt8.copy_(x.t())

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cast()
        gemm()
        torch.cuda.current_stream().wait_stream(side)

    tg, tc, tb = timed(gemm), timed(cast), timed(both)
    hidden = (tg + tc - tb) / tc if tc > 0 else 0.0
    tot = [tot[0] + tg, tot[1] + tc, tot[2] + tb]
    print(f"  {name:5} {cin:>5}->{cout:<5} dgrad {tg:.3f} ms, cast {tc:.3f} ms, both at once {tb:.3f} ms "
          f"(one after the other {tg + tc:.3f}): {100 * hidden:.0f}% of the cast hidden")
print(f"  the four layers: dgrad {tot[0]:.3f} ms, casts {tot[1]:.3f} ms, at once {tot[2]:.3f} ms: "
      f"{100 * (tot[0] + tot[1] - tot[2]) / tot[1]:.0f}% of the casts hidden")
