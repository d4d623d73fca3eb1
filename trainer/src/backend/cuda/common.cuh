// Shared prelude of every CUDA kernel source in this directory (prepended by the
// loader, so each .cu file compiles on its own with NVRTC and needs no CUDA headers).
//
// bf16 values travel as raw 16-bit words: conversion is a shift one way and the
// hardware round-to-nearest-even instruction the other, which is exactly what
// half::bf16::from_f32 does on the host, so host- and device-rounded values agree.

typedef unsigned short bf16_t;
typedef unsigned long long u64;

// No math.h under NVRTC without headers: spell infinity out.
#define F_INF __int_as_float(0x7f800000)
#define LOG2E_F 1.4426950408889634f

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// 8 bf16 in one 16-byte word <-> 8 floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = (unsigned)f2bf(f[2 * i]) | ((unsigned)f2bf(f[2 * i + 1]) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15) == 0; }

// GELU, tanh approximation as in GPT-2 (twin of cpu/activation.rs): here so that the FP8 cast
// that quantizes GELU's output as it reads the pre-activation (fp8.cu) computes the bits
// gelu_fwd (activation.cu) would have written.
// Written as x·sigmoid(2u) (= 0.5·x·(1 + tanh u), u = sqrt(2/pi)·(x + 0.044715·x³)) with the
// hardware's exp2 and division approximations: tanhf made the FP8 path's GELU passes
// compute-bound (an amax-only pass at 1.8 TB/s on an H200), and this form has no
// cancellation where 1 + tanh u nears 0. It differs from the CPU's tanhf form by a few f32
// ulps, below bf16's rounding but for the odd last bit (the GPU tests' bf16 tolerance).
#define GELU_K 0.7978845608f  // sqrt(2/pi)

// sigmoid(2u) of GELU's tanh argument u(x).
__device__ __forceinline__ float gelu_sig(float x) {
    const float u = GELU_K * (x + 0.044715f * x * x * x);
    return __fdividef(1.f, 1.f + __expf(-2.f * u));
}

__device__ __forceinline__ float gelu_f(float x) { return x * gelu_sig(x); }

// GELU of 8 bf16 in one 16-byte word, each rounded to bf16 (gelu_fwd's outputs).
__device__ __forceinline__ uint4 gelu8(uint4 v) {
    float x[8];
    unpack8(v, x);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = gelu_f(x[k]);
    return pack8(x);
}

// d/dx x·s(x), s = sigmoid(2u): s + x·2s(1 - s)·u'(x) (0.5·(1 + tanh u) = s, sech² u = 4s(1 - s)).
__device__ __forceinline__ float gelu_grad(float x) {
    const float s = gelu_sig(x);
    return s + 2.f * x * s * (1.f - s) * GELU_K * (1.f + 3.f * 0.044715f * x * x);
}

// SwiGLU (activation.cu's swiglu_fwd/swiglu_bwd: one expression each). sigmoid through __expf: its error (a few ulp of
// fp32) is far below the bf16 output's. exp(-x) overflowing (x < -88) gives sigmoid 0 and
// silu -0, as the exact function rounds.
__device__ __forceinline__ float sigmoid_f(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// silu(gate)·up.
__device__ __forceinline__ float swiglu_f(float a, float u) { return a * sigmoid_f(a) * u; }

// The gradients of silu(a)·u given dy: dgate = dy·u·silu'(a), silu'(a) = s(1 + a(1 - s)), and
// dup = dy·silu(a).
__device__ __forceinline__ void swiglu_grads(float a, float u, float dy, float& dg, float& du) {
    const float s = sigmoid_f(a);
    dg = dy * u * s * (1.f + a * (1.f - s));
    du = dy * a * s;
}

// GELU'(pre)·d of 8 bf16 pairs, each rounded to bf16 (gelu_bwd's outputs).
__device__ __forceinline__ uint4 dgelu8(uint4 pre, uint4 d) {
    float x[8], g[8];
    unpack8(pre, x);
    unpack8(d, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = gelu_grad(x[k]) * g[k];
    return pack8(x);
}

// |x| of a bf16 as the bits of its f32 value: non-negative floats order as their bits, and
// a NaN's bits lie above infinity's, so an integer max propagates NaN (fmaxf would drop it).
// The FP8 amax (fp8.cu) and the producers that leave one (an FP8 amax sink) keep maxima so.
__device__ __forceinline__ unsigned abs_bits(bf16_t x) { return ((unsigned)x << 16) & 0x7fffffffu; }

__device__ __forceinline__ unsigned max_abs_bits2(unsigned w, unsigned m) {
    return max(m, max((w << 16) & 0x7fffffffu, w & 0x7fff0000u));
}

// m max-ed with the |x| bits of 8 bf16 in one 16-byte word.
__device__ __forceinline__ unsigned max_abs8(uint4 v, unsigned m) {
    return max_abs_bits2(v.x, max_abs_bits2(v.y, max_abs_bits2(v.z, max_abs_bits2(v.w, m))));
}

// A producer's FP8 amax sink: the warp's largest of its lanes' `m` (|x| bits of what they
// wrote) max-ed into *amax, which the launch code zeroed; nothing where amax is null. Every
// lane of the warp calls it together. The plain read first skips the atomic where the sink
// already holds as much (it only grows), so few of a grid's warps contend for the address.
__device__ __forceinline__ void warp_amax_out(unsigned* amax, unsigned m) {
    if (amax == nullptr) return;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0 && m != 0 && m > *(volatile unsigned*)amax) atomicMax(amax, m);
}

// The element-wise kernels' grid-stride loop: when `vectors` (the pointers allow wide
// accesses), `vec(i)` handles elements [V i, V i + V) for every whole vector, then `one(i)`
// each element after them; otherwise `one(i)` handles every element.
template <int V, class Vec, class One>
__device__ __forceinline__ void grid_stride(long long n, bool vectors, Vec vec, One one) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long done = 0;
    if (vectors) {
        const long long nv = n / V;
        for (long long i = t0; i < nv; i += stride) vec(i);
        done = nv * V;
    }
    for (long long i = done + t0; i < n; i += stride) one(i);
}

// grid_stride with U vector turns per loop iteration, for kernels that only read (an amax):
// their U loads can all be in flight before the first turn's arithmetic (a read-only pass
// with one 16-byte load in flight per thread ran at ~1.9 TB/s on an H200). The same
// elements, each once, as grid_stride.
template <int V, int U, class Vec, class One>
__device__ __forceinline__ void grid_stride_reads(long long n, bool vectors, Vec vec, One one) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long done = 0;
    if (vectors) {
        const long long nv = n / V;
        long long i = t0;
        for (; i + (U - 1) * stride < nv; i += U * stride) {
#pragma unroll
            for (int u = 0; u < U; ++u) vec(i + u * stride);
        }
        for (; i < nv; i += stride) vec(i);
        done = nv * V;
    }
    for (long long i = done + t0; i < n; i += stride) one(i);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32), returned to every thread.
// The tree has a fixed shape, so the result is the same bits on every run. `sh` must
// hold 32 floats; the leading barrier makes back-to-back calls on one `sh` safe.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : 0.f;
    return warp_sum(r);
}

__device__ __forceinline__ double block_sum_d(double v, double* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    double r = lane < nw ? sh[lane] : 0.0;
    return warp_sum_d(r);
}

__device__ __forceinline__ float block_max(float v, float* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : -F_INF;
    return warp_max(r);
}

// Shared-memory address of a generic pointer, for PTX that takes one (cp.async, ldmatrix).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// cp.async groups: the copies a thread issued since its last commit form one group;
// cp_wait<N> returns once at most its N newest groups are still in flight (its own
// copies: another thread's need a barrier before they are read).
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// ---- FP8 codes (fp8.cu's casts; adamw.cu's step writing an FP8 layer's cached weight) ----

// Fp8Format::scale of backend/fp8.rs on the bits: the largest 2^e, e in -126..126, with
// amax·2^e <= max (448 = 1.75·2^8 for e4m3, 57344 = 1.75·2^15 for e5m2); 1 for amax = 0,
// NaN for a non-finite amax.
__device__ __forceinline__ float fp8_scale(unsigned amax, int e5m2) {
    if (amax >= 0x7f800000u) return __int_as_float(0x7fffffff);
    if (amax == 0) return 1.f;
    int ea;
    unsigned ma = amax & 0x7fffffu;
    const int field = (int)(amax >> 23);
    if (field == 0) {
        const int lz = __clz(ma) - 8;
        ma = (ma << lz) & 0x7fffffu;
        ea = 1 - lz - 127;
    } else {
        ea = field - 127;
    }
    const int ef = e5m2 ? 15 : 8;
    const unsigned mf = 0x600000u;  // the fraction bits of 1.75
    int e = ef - ea - (ma > mf ? 1 : 0);
    e = min(max(e, -126), 126);
    return __int_as_float((e + 127) << 23);
}

// Two floats to two FP8 codes (lo in the low byte): round to nearest even, saturating to the
// largest finite value (what Fp8Format::encode does). Hopper and Ada have the instruction;
// elsewhere FP8 is refused before any kernel runs (fp8.rs), so the kernels trap there.
__device__ __forceinline__ unsigned cvt2(float lo, float hi, int e5m2) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    if (e5m2)
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    asm volatile("trap;");
    return 0u * (unsigned)(lo + hi + e5m2);
#endif
}

// 8 bf16 (one 16-byte word) scaled by s into 8 codes (one 8-byte word).
__device__ __forceinline__ uint2 cvt8(uint4 v, float s, int e5m2) {
    float f[8];
    unpack8(v, f);
    const unsigned b0 = cvt2(f[0] * s, f[1] * s, e5m2), b1 = cvt2(f[2] * s, f[3] * s, e5m2);
    const unsigned b2 = cvt2(f[4] * s, f[5] * s, e5m2), b3 = cvt2(f[6] * s, f[7] * s, e5m2);
    return make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
}

// The transposing FP8 casts' tile: FP8_TILE_R rows × FP8_TILE_C columns of x, 256 threads,
// thread (g = tid / 8, cg = tid % 8) taking rows 4g..4g+3 × columns 8cg..8cg+7.
#define FP8_TILE_C 64   // columns of x in a tile (rows of qt)
#define FP8_TILE_R 128  // rows of x in a tile: 32 groups of 4 rows, one per 8 threads

// A transposing tile of TC columns × TR rows for 256 threads, each taking 4 rows × 8 columns:
// TC / 8 threads a row group, 256 / (TC / 8) groups of 4 rows (TR of them).
template <int TC, int TR>
struct Fp8TileOf {
    static constexpr int per_row = TC / 8;
    static constexpr int groups = 256 / per_row;
    static_assert(4 * groups == TR, "a tile is 256 threads of 4 rows x 8 columns");
    // The codes in shared memory for the transposed store: t[c][g] is column c's codes of
    // rows 4g..4g+3 (one word of padding per column: fewer bank conflicts).
    typedef unsigned Words[TC][groups + 1];
};
typedef Fp8TileOf<FP8_TILE_C, FP8_TILE_R>::Words Fp8TileWords;

// A thread's 4 rows × 8 columns of codes (b[i]: row i's 8 bytes) into t, as words of one
// column's 4 rows: byte k of b[i].x is (row i, column k); interleave rows 0,1 and 2,3, then the
// pairs, so that word k holds column k's rows 0..3 in byte order (qt's layout).
template <int TC = FP8_TILE_C, int TR = FP8_TILE_R>
__device__ __forceinline__ void fp8_tile_words(typename Fp8TileOf<TC, TR>::Words& t, const uint2* b, int cg, int g) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned w0 = h ? b[0].y : b[0].x, w1 = h ? b[1].y : b[1].x;
        const unsigned w2 = h ? b[2].y : b[2].x, w3 = h ? b[3].y : b[3].x;
        const unsigned lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
        const unsigned lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
        const int c = 8 * cg + 4 * h;
        t[c + 0][g] = __byte_perm(lo01, lo23, 0x5410);
        t[c + 1][g] = __byte_perm(lo01, lo23, 0x7632);
        t[c + 2][g] = __byte_perm(hi01, hi23, 0x5410);
        t[c + 3][g] = __byte_perm(hi01, hi23, 0x7632);
    }
}

// The tile at (r0, c0) of x [rows, cols] from t into qt [cols, rows]: TC of qt's rows × TR / 16
// chunks of 16 codes (all in or all out: rows, cols % 16 == 0). The block synchronizes between
// fp8_tile_words and this.
template <int TC = FP8_TILE_C, int TR = FP8_TILE_R>
__device__ __forceinline__ void fp8_tile_store_t(unsigned char* qt, const typename Fp8TileOf<TC, TR>::Words& t, int r0,
                                                 int c0, int rows, int cols) {
    constexpr int chunks = TR / 16;
    for (int k = threadIdx.x; k < TC * chunks; k += blockDim.x) {
        const int c = k / chunks, ch = k % chunks;
        const int oc = c0 + c, orow = r0 + 16 * ch;
        if (oc < cols && orow < rows)
            *(uint4*)(qt + (long long)oc * rows + orow) =
                make_uint4(t[c][4 * ch], t[c][4 * ch + 1], t[c][4 * ch + 2], t[c][4 * ch + 3]);
    }
}
