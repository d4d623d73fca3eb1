#!/usr/bin/env bash
# The transposing FP8 cast at GPT-2 1.5B's shapes, as the trainer launches it and at
# several grids, beside a copy (dev/fp8_cast_bench.cu). Builds with
# nvcc (the GPU machine's, or any CUDA 13 nvcc: BENCH=path runs a binary built elsewhere):
#   dev/fp8-cast-variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source dev/bench_util.sh
run_cuda_bench fp8_cast_bench "fp8.cu" -DFP8G_SEGS=16 -DFP8_STEP_WEIGHTS=8
