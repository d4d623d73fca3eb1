# The median (ms) of CUDA-event-timed repeats of a PyTorch callable, after warm-up calls:
# shared by the scripts that time PyTorch beside `gpu-timing` (sdpa_timing.py, gemm_timing.py).
import torch


def timed(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]
