#!/usr/bin/env bash
# Time variants of the head-size-64 attention forward kernel side by side, outside the
# trainer: each variant is a copy of attention.cu (edited by hand), built with the GPU
# machine's nvcc into its own binary around scripts/attn_fwd_bench.cu, which times
# attn_fwd_mma64 (median of 30) and prints a checksum of its output and log-sum-exp (a
# variant that computes the same function prints the same checksum). Run on the GPU machine:
#
#   scripts/attn-fwd-variants.sh NAME=PATH/attention.cu:ROWS:SMEM_BYTES ...
#   e.g. cur=trainer/src/backend/cuda/attention.cu:64:36864
#
# ROWS: query rows per block (the grid's x is ceil(T / ROWS)); SMEM_BYTES: the dynamic
# shared memory the variant needs. ARCH (default -arch=sm_90) is passed to nvcc; wgmma
# variants need ARCH=-gencode=arch=compute_90a,code=sm_90a (copies from before grouped-query
# attention, whose kernels take no key/value head count, also -DPRE_GQA). Shapes: B NH T = 16 12 1024 (GPT-2 124M), 4 16 1024,
# 4 16 2048, 8 25 1024 (1.5B). Used for BENCHMARKS.md run 9's forward experiments.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
cp scripts/attn_fwd_bench.cu trainer/src/backend/cuda/common.cuh "$work/"
names=()
for spec in "$@"; do
    name=${spec%%=*}; rest=${spec#*=}
    IFS=: read -r src rows smem <<< "$rest"
    cp "$src" "$work/$name.cu"
    (cd "$work" && nvcc ${ARCH:--arch=sm_90} -O3 -std=c++17 -Xptxas -v -DSRC="\"$name.cu\"" -DKERNEL=attn_fwd_mma64 -DHSZ=64 \
        -DGRID_ROWS="$rows" -DSMEM="$smem" -DVARIANT="\"$name\"" attn_fwd_bench.cu -o "bin_$name" 2> "ptxas_$name.log" \
        && awk "/entry function 'attn_fwd_mma64'/{f=1} f&&/Used/{print \"$name:\", \$0; exit}" "ptxas_$name.log") &
    names+=("$name")
done
wait
for s in "16 12 1024" "4 16 1024" "4 16 2048" "8 25 1024"; do
    for n in "${names[@]}"; do "$work/bin_$n" $s; done
done
