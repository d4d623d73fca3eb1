// Memory and copies (twin of cpu/memory.rs): fp32 -> bf16 rounding of master weights into
// compute parameters, and gradient accumulation. As the activation kernels do: four elements
// a thread with 16-byte loads where the pointers are aligned for it, then the rest (or, when
// they are not, everything) one element a thread; both paths round and add alike.

extern "C" __global__ void cast_f32_bf16(bf16_t* dst, const float* src, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long done = 0;
    if (aligned16(src) && (((u64)dst) & 7) == 0) {  // 4 bf16 = 8 bytes a store
        const long long nv = n / 4;
        for (long long i = t0; i < nv; i += stride) {
            const float4 x = ((const float4*)src)[i];
            ((uint2*)dst)[i] = make_uint2((unsigned)f2bf(x.x) | ((unsigned)f2bf(x.y) << 16),
                                          (unsigned)f2bf(x.z) | ((unsigned)f2bf(x.w) << 16));
        }
        done = nv * 4;
    }
    for (long long i = done + t0; i < n; i += stride) dst[i] = f2bf(src[i]);
}

extern "C" __global__ void add_f32(float* dst, const float* src, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long done = 0;
    if (aligned16(dst) && aligned16(src)) {
        const long long nv = n / 4;
        for (long long i = t0; i < nv; i += stride) {
            float4 d = ((float4*)dst)[i];
            const float4 s = ((const float4*)src)[i];
            d.x += s.x;
            d.y += s.y;
            d.z += s.z;
            d.w += s.w;
            ((float4*)dst)[i] = d;
        }
        done = nv * 4;
    }
    for (long long i = done + t0; i < n; i += stride) dst[i] += src[i];
}
