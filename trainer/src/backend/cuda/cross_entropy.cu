// Fused softmax + cross-entropy forward and backward (twin of cpu/cross_entropy.rs):
// one block per row. Pass 1 keeps an online (max, sum of exp) per thread in fp32 and
// merges them across the block; pass 2 overwrites the row with
// (softmax - onehot(target)) * dloss_scale. The loss per row is fp32.
//
// Rows of an odd vocabulary are not 16-byte aligned, so each pass walks a scalar head
// up to the first aligned element, then 16-byte vectors, then a scalar tail.

__device__ __forceinline__ void online_add(float& m, float& s, float x) {
    if (x > m) {
        s = s * __expf(m - x) + 1.f;
        m = x;
    } else {
        s += __expf(x - m);
    }
}

__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -F_INF) return;  // both empty
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

// blockDim.x = 1024 (any multiple of 32 up to 1024 works).
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

    float m = -F_INF, s = 0.f;
    for (int j = threadIdx.x; j < head; j += blockDim.x) online_add(m, s, bf2f(row[j]));
    for (int k = threadIdx.x; k < nvec; k += blockDim.x) {
        float f[8];
        unpack8(vrow[k], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) online_add(m, s, f[q]);
    }
    for (int j = tail + threadIdx.x; j < V; j += blockDim.x) online_add(m, s, bf2f(row[j]));
    if (threadIdx.x == 0) s_tgt = tgt < (unsigned)V ? bf2f(row[tgt]) : __int_as_float(0x7fc00000);
    // Merge across the warp, then across warps (fixed order: deterministic).
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
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
    for (int j = threadIdx.x; j < head; j += blockDim.x) {
        const float p = expf(bf2f(row[j]) - m) * inv;
        row[j] = f2bf(p * dloss_scale - (j == (int)tgt ? dloss_scale : 0.f));
    }
    for (int k = threadIdx.x; k < nvec; k += blockDim.x) {
        float f[8];
        unpack8(vrow[k], f);
        const int j0 = head + k * 8;
#pragma unroll
        for (int q = 0; q < 8; ++q)
            f[q] = expf(f[q] - m) * inv * dloss_scale - (j0 + q == (int)tgt ? dloss_scale : 0.f);
        vrow[k] = pack8(f);
    }
    for (int j = tail + threadIdx.x; j < V; j += blockDim.x) {
        const float p = expf(bf2f(row[j]) - m) * inv;
        row[j] = f2bf(p * dloss_scale - (j == (int)tgt ? dloss_scale : 0.f));
    }
}
