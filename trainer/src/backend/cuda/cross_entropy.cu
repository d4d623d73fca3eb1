// Fused softmax + cross-entropy forward and backward (twin of cpu/cross_entropy.rs):
// one block per row. Pass 1 keeps an online (max, sum of exp) per thread in fp32 and
// merges them across the block; pass 2 overwrites the row with
// (softmax - onehot(target)) * dloss_scale. The loss per row is fp32.
//
// Rows of an odd vocabulary are not 16-byte aligned, so each pass walks a scalar head
// up to the first aligned element, then 16-byte vectors, then a scalar tail. The vector
// loops load CE_UNROLL vectors a thread before using any: with one 16-byte load in flight
// per thread an SM had too few bytes in flight to keep HBM busy.

__device__ __forceinline__ void online_add(float& m, float& s, float x) {
    if (x > m) {
        s = s * __expf(m - x) + 1.f;
        m = x;
    } else {
        s += __expf(x - m);
    }
}

// Eight values at once: one rescale (by the largest of the eight) instead of one per value.
__device__ __forceinline__ void online_add8(float& m, float& s, const float* f) {
    float mx = f[0];
#pragma unroll
    for (int q = 1; q < 8; ++q) mx = fmaxf(mx, f[q]);
    if (mx > m) {
        s *= __expf(m - mx);
        m = mx;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) s += __expf(f[q] - m);
}

#define CE_UNROLL 4

__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -F_INF) return;  // both empty
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

// blockDim.x: any multiple of 32 up to 1024. Launched with 512 (48 registers: two rows an
// SM, each thread with CE_UNROLL 16-byte loads in flight); on an H200 this beat 1024
// threads with one load each (1.20-1.31 -> 0.99-1.05 ms at 16384 x 50304) and variants
// with more rows an SM and fewer loads (CE_UNROLL 2 or 3, or 32 registers with spills).
extern "C" __global__ void cross_entropy_fwd_bwd(bf16_t* logits, float* losses, const unsigned* targets,
                                                 int V, float dloss_scale) {
    __shared__ float sm[32], ss[32];
    __shared__ float s_tgt;
    const long long rowi = blockIdx.x;
    bf16_t* row = logits + rowi * V;
    const unsigned tgt = targets[rowi];
    int head = (int)(((16 - (((u64)row) & 15)) & 15) >> 1);
    if (head > V) head = V;
    const int nvec = (V - head) / 8;
    const int tail = head + nvec * 8;
    uint4* vrow = (uint4*)(row + head);
    const int nt = blockDim.x;

    float m = -F_INF, s = 0.f;
    for (int j = threadIdx.x; j < head; j += nt) online_add(m, s, bf2f(row[j]));
    int k = threadIdx.x;
    for (; k + (CE_UNROLL - 1) * nt < nvec; k += CE_UNROLL * nt) {
        uint4 r[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) r[u] = vrow[k + u * nt];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) {
            float f[8];
            unpack8(r[u], f);
            online_add8(m, s, f);
        }
    }
    for (; k < nvec; k += nt) {
        float f[8];
        unpack8(vrow[k], f);
        online_add8(m, s, f);
    }
    for (int j = tail + threadIdx.x; j < V; j += nt) online_add(m, s, bf2f(row[j]));
    if (threadIdx.x == 0) s_tgt = tgt < (unsigned)V ? bf2f(row[tgt]) : __int_as_float(0x7fc00000);
    // Merge across the warp, then across warps (fixed order: deterministic).
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = nt >> 5;
    if (lane == 0) {
        sm[w] = m;
        ss[w] = s;
    }
    __syncthreads();
    m = lane < nw ? sm[lane] : -F_INF;
    s = lane < nw ? ss[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
    // Every thread now holds the row's (m, s); s_tgt was read before the barrier above,
    // so overwriting the row below cannot race with it.
    if (threadIdx.x == 0) losses[rowi] = (m + logf(s)) - s_tgt;
    const float inv = 1.f / s;
    for (int j = threadIdx.x; j < head; j += nt) {
        const float p = __expf(bf2f(row[j]) - m) * inv;
        row[j] = f2bf(p * dloss_scale - (j == (int)tgt ? dloss_scale : 0.f));
    }
    // Gradient of one vector of 8 logits starting at column j0.
    auto grad8 = [&](uint4 v, int j0) {
        float f[8];
        unpack8(v, f);
#pragma unroll
        for (int q = 0; q < 8; ++q)
            f[q] = __expf(f[q] - m) * inv * dloss_scale - (j0 + q == (int)tgt ? dloss_scale : 0.f);
        return pack8(f);
    };
    k = threadIdx.x;
    for (; k + (CE_UNROLL - 1) * nt < nvec; k += CE_UNROLL * nt) {
        uint4 r[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) r[u] = vrow[k + u * nt];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) vrow[k + u * nt] = grad8(r[u], head + (k + u * nt) * 8);
    }
    for (; k < nvec; k += nt) vrow[k] = grad8(vrow[k], head + k * 8);
    for (int j = tail + threadIdx.x; j < V; j += nt) {
        const float p = __expf(bf2f(row[j]) - m) * inv;
        row[j] = f2bf(p * dloss_scale - (j == (int)tgt ? dloss_scale : 0.f));
    }
}
