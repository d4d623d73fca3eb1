#!/usr/bin/env bash
# The optimizer step's FP8 codes (adamw_fp8) against the flat update and the cast after it, at
# one GPT-2 1.5B block's weights, outside the trainer (dev/adamw_fp8_bench.cu: each variant
# from the same state, checksums that must agree, the median of 30). Builds with nvcc (the GPU
# machine's, or any CUDA 13 nvcc: BENCH=path runs a binary built elsewhere) and runs it:
#   dev/adamw-fp8-variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source dev/bench_util.sh
run_cuda_bench adamw_fp8_bench "adamw.cu fp8.cu" -DADAMW_SEGS=16 -DFP8_STEP_WEIGHTS=8 -DFP8G_SEGS=16
