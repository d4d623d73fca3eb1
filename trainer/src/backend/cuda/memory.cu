// Memory and copies (twin of cpu/memory.rs): fp32 -> bf16 rounding of master weights into
// compute parameters, and gradient accumulation.

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
