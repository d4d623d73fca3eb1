# What the standalone CUDA benches' runners (dev/*-variants.sh) share, sourced from the
# repository root: run_cuda_bench NAME "KERNEL FILES" NVCC_DEFINES... builds dev/NAME.cu
# beside dev/bench_util.cuh and the trainer's common.cuh and the kernel files named
# (trainer/src/backend/cuda/) with the machine's nvcc, and runs it; BENCH=path runs a binary
# built elsewhere (any CUDA 13 nvcc) instead.
run_cuda_bench() {
    local name=$1 kernels=$2 bin=${BENCH:-} work k
    shift 2
    if [[ -z $bin ]]; then
        work=$(mktemp -d)
        cp "dev/$name.cu" dev/bench_util.cuh trainer/src/backend/cuda/common.cuh "$work/"
        for k in $kernels; do cp "trainer/src/backend/cuda/$k" "$work/"; done
        (cd "$work" && nvcc -arch=sm_90 -O3 -std=c++17 "$@" "$name.cu" -o "$name")
        bin=$work/$name
    fi
    "$bin"
}
