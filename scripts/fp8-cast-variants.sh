#!/usr/bin/env bash
# The transposing FP8 cast at GPT-2 1.5B's shapes, as the trainer launches it and at
# several grids, beside a copy (scripts/fp8_cast_bench.cu). Builds with
# nvcc (the GPU machine's, or any CUDA 13 nvcc: BENCH=path runs a binary built elsewhere):
#   scripts/fp8-cast-variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BENCH:-}
if [[ -z $bin ]]; then
    work=$(mktemp -d)
    cp scripts/fp8_cast_bench.cu scripts/bench_util.cuh trainer/src/backend/cuda/{common.cuh,fp8.cu} "$work/"
    (cd "$work" && nvcc -arch=sm_90 -O3 -std=c++17 -DFP8G_SEGS=16 -DFP8_STEP_WEIGHTS=8 fp8_cast_bench.cu -o fp8_cast_bench)
    bin=$work/fp8_cast_bench
fi
"$bin"
