// Buffer utilities (the CPU twins are inline in cpu/mod.rs): fp32 -> bf16 rounding,
// gradient accumulation, and the ordered reduction of per-block partial sums that keeps
// the column-sum kernels deterministic.

extern "C" __global__ void cast_f32_bf16(bf16_t* dst, const float* src, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = f2bf(src[i]);
}

extern "C" __global__ void add_f32(float* dst, const float* src, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

// partial is [nchunks, W]; for j < W: s = sum over chunks in order; j < split goes to
// dst0[j] += s, the rest to dst1[j - split] += s.
extern "C" __global__ void reduce_partials(float* dst0, float* dst1, int split, const float* partial,
                                           int nchunks, int W) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= W) return;
    float s = 0.f;
    for (int k = 0; k < nchunks; ++k) s += partial[(long long)k * W + j];
    if (j < split) dst0[j] += s;
    else dst1[j - split] += s;
}
