#!/usr/bin/env bash
# GPT-2 1.5B's LayerNorm kernels (8192 × 1600) and variants of them, outside the trainer
# (dev/layernorm_bench.cu: the trainer's layernorm.cu and reduce.cu, the median of 30,
# each variant's largest difference from the trainer's results). Builds with nvcc (the GPU
# machine's, or any CUDA 13 nvcc: BENCH=path runs a binary built elsewhere) and runs it:
#   dev/layernorm-variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source dev/bench_util.sh
run_cuda_bench layernorm_bench "layernorm.cu reduce.cu" -DLN_EPS=1e-5f -DLN_BWD_SLOTS=4 -DLN_BWD_MAX_ROWS=64 -DRMS_FWD_THREADS=256 -DRP_ROWS=32
