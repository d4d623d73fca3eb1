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

// SwiGLU (activation.cu's swiglu_fwd/swiglu_bwd and the FP8 casts that apply them, fp8.cu:
// one expression each, so the same bits). sigmoid through __expf: its error (a few ulp of
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
