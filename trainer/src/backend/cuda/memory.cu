// Memory and copies (twin of cpu/memory.rs): fp32 -> bf16 rounding of master weights into
// compute parameters, and gradient accumulation. Each has a four-elements-a-thread kernel
// (16-byte loads; memory.rs launches it when the pointers are aligned for it) and the
// one-element kernel for any other alignment; both round and add exactly alike.

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

// src 16-byte aligned, dst 8-byte aligned; the last n % 4 elements one a thread.
extern "C" __global__ void cast_f32_bf16_x4(bf16_t* dst, const float* src, long long n) {
    const long long n4 = n / 4, tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (long long i = tid; i < n4; i += (long long)gridDim.x * blockDim.x) {
        const float4 x = ((const float4*)src)[i];
        ((uint2*)dst)[i] = make_uint2((unsigned)f2bf(x.x) | ((unsigned)f2bf(x.y) << 16),
                                      (unsigned)f2bf(x.z) | ((unsigned)f2bf(x.w) << 16));
    }
    if (tid < n - 4 * n4) dst[4 * n4 + tid] = f2bf(src[4 * n4 + tid]);
}

// dst and src 16-byte aligned; the last n % 4 elements one a thread.
extern "C" __global__ void add_f32_x4(float* dst, const float* src, long long n) {
    const long long n4 = n / 4, tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (long long i = tid; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 d = ((float4*)dst)[i];
        const float4 s = ((const float4*)src)[i];
        d.x += s.x;
        d.y += s.y;
        d.z += s.z;
        d.w += s.w;
        ((float4*)dst)[i] = d;
    }
    if (tid < n - 4 * n4) dst[4 * n4 + tid] += src[4 * n4 + tid];
}
