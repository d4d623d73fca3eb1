// Memory and copies (twin of cpu/memory.rs): fp32 -> bf16 rounding of master weights into
// compute parameters, and gradient accumulation. Through `grid_stride` (common.cuh), as the
// activation kernels: four elements a thread with 16-byte loads where the pointers are
// aligned for it, then the rest (or, when they are not, everything) one element a thread;
// both paths round and add alike.

extern "C" __global__ void cast_f32_bf16(bf16_t* dst, const float* src, long long n) {
    const bool vectors = aligned16(src) && (((u64)dst) & 7) == 0;  // 4 bf16 = 8 bytes a store
    grid_stride<4>(
        n, vectors,
        [&](long long i) {
            const float4 x = ((const float4*)src)[i];
            ((uint2*)dst)[i] = make_uint2((unsigned)f2bf(x.x) | ((unsigned)f2bf(x.y) << 16),
                                          (unsigned)f2bf(x.z) | ((unsigned)f2bf(x.w) << 16));
        },
        [&](long long i) { dst[i] = f2bf(src[i]); });
}

extern "C" __global__ void add_f32(float* dst, const float* src, long long n) {
    grid_stride<4>(
        n, aligned16(dst) && aligned16(src),
        [&](long long i) {
            float4 d = ((float4*)dst)[i];
            const float4 s = ((const float4*)src)[i];
            d.x += s.x;
            d.y += s.y;
            d.z += s.z;
            d.w += s.w;
            ((float4*)dst)[i] = d;
        },
        [&](long long i) { dst[i] += src[i]; });
}
