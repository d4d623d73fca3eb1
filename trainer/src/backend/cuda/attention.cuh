// What every attention kernel file shares (attention.cu and its generations: see there),
// prepended to each by attention.rs: the qkv layout, the document mask's helpers, the dK/dV
// grid, and the dot product D's kernels start from.

// Row stride of qkv (and dqkv): NH query heads, NKV key heads, NKV value heads.
template <int HS>
__device__ __forceinline__ long long qkv_stride(int NH, int NKV) {
    return (long long)(NH + 2 * NKV) * HS;
}
// blockIdx.y, blockIdx.z read where used (volatile: not hoisted out of a loop, so what is
// derived from them need not hold registers through it).
__device__ __forceinline__ int ctaid_y() {
    int r;
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r));
    return r;
}
__device__ __forceinline__ int ctaid_z() {
    int r;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(r));
    return r;
}
// Batch b's first row of query head h's key head (its value head is NKV * HS after it).
template <int HS>
__device__ __forceinline__ const bf16_t* kv_head(const bf16_t* qkv, int b, int T, int NH, int NKV, int h) {
    return qkv + (long long)b * T * qkv_stride<HS>(NH, NKV) + (NH + h / (NH / NKV)) * HS;
}

// Row q's document start (a row past T takes the last row's; 0 without documents).
template <bool DOCS>
__device__ __forceinline__ int doc_start(const unsigned* docs_b, int q, int T) {
    return DOCS ? (int)docs_b[min(q, T - 1)] : 0;
}

// The first key tile (of `rows` keys) a query tile whose first row is q0 attends: 0 without
// documents, else the tile of q0's document start.
template <bool DOCS>
__device__ __forceinline__ int doc_first_tile(const unsigned* docs_b, int q0, int rows) {
    return DOCS ? min((int)docs_b[q0], q0) / rows : 0;
}

// How many query tiles of 64 from kt on hold a query that attends a key of tile kt (its last
// key kl): those whose first row's document starts at or before kl (a prefix of them, see
// the top of the file). Block-wide (a barrier per blockDim tiles): every thread calls it.
__device__ __forceinline__ int doc_query_tiles(const unsigned* docs_b, int kt, int nt, int kl) {
    int n = 0;
    for (int j0 = kt; j0 < nt; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        const int c = __syncthreads_count(j < nt && (int)docs_b[j * 64] <= kl);
        n += c;
        if (c < (int)blockDim.x) break;  // (the same count in every thread)
    }
    return max(n, 1);  // (tile kt itself always: ds(k0) <= k0)
}

// The documents of key tile kt (keys k0 = 64 kt .. kl, kl < T its last), for the tensor-core
// dK/dV kernels, into shared memory (read only where a tile needs them: these kernels have
// no registers to spare): ke[i] = end(k0 + i) (see the top of the file), and nq[0] = the
// number of query tiles from kt on that attend the tile (to the one holding the last row of
// kl's document). Block-wide (barriers: every thread calls it); the results are there after
// the caller's next barrier. starts: 2 words of shared scratch.
__device__ __forceinline__ void doc_key_ends(const unsigned* docs_b, int kt, int nt, int T, int* ke, int* nq,
                                             unsigned* starts) {
    const int k0 = kt * 64, kl = min(k0 + 63, T - 1), i = threadIdx.x;
    // Query tiles after kt whose first row is in kl's document or an earlier one (a prefix).
    int jt = 0;
    for (int j0 = kt + 1; j0 < nt; j0 += blockDim.x) {
        const int j = j0 + i;
        const int c = __syncthreads_count(j < nt && (int)docs_b[j * 64] <= kl);
        jt += c;
        if (c < (int)blockDim.x) break;  // (the same count in every thread)
    }
    // kl's document ends in query tile kt + jt: its rows up to there (a prefix of the tile).
    const int jl = kt + jt, r = 64 * jl + i;
    const int kend = 64 * jl + __syncthreads_count(i < 64 && r < T && (int)docs_b[r] <= kl);
    // Documents that start inside the key tile (after k0): bit i of a 64-bit mask for key k0 + i.
    const unsigned bits = __ballot_sync(0xffffffffu, i < 64 && i > 0 && k0 + i <= kl && (int)docs_b[k0 + i] == k0 + i);
    if (i < 64 && (i & 31) == 0) starts[i >> 5] = bits;
    __syncthreads();
    if (i < 64) {
        const unsigned long long m = starts[0] | ((unsigned long long)starts[1] << 32);
        const unsigned long long later = i < 63 ? m & (~0ull << (i + 1)) : 0ull;
        ke[i] = later ? k0 + __ffsll((long long)later) - 1 : kend;
    }
    if (i == 0) nq[0] = jt + 1;
}

// The dK/dV block's (key tile, key/value head, batch, split). Multi-head (NKV = NH): grid
// (nt, NH, B), as the other passes, one split. Grouped: grid (S NKV B, nt), the key tile
// slowest. A grouped block does G times a multi-head block's work (key tile kt: G (nt - kt)
// query tiles) and there are G times fewer of them, so a long block that starts late is the
// kernel's tail: blocks start in linear order, and this order starts every head's and batch's
// longest blocks (small kt) first, then the shorter ones fill in behind them (longest
// processing time first, within a few per cent of the ideal makespan when there are more
// than about twice as many blocks as fit the GPU at once). S > 1 splits each block's
// G (nt - kt) tiles into S runs of consecutive ones (split s: [s n / S, (s + 1) n / S)),
// for grids too small to fill the GPU that way; see attention.rs.
struct DkvBlock {
    int kt, hk, b, s;
};
__device__ __forceinline__ DkvBlock dkv_block(int NH, int NKV, int S) {
    if (NH == NKV) return DkvBlock{(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, 0};
    const int x = blockIdx.x, r = x / S;
    return DkvBlock{(int)blockIdx.y, r % NKV, r / NKV, x % S};
}

// A split dK/dV block's fp32 partial sums (grid x = (b NKV + hk) S + s) for key k: HS of dK
// (before the softmax scale), then HS of dV. part holds [B NKV][S][T][2 HS] floats.
template <int HS>
__device__ __forceinline__ float* dkv_part_row(float* part, int T, int k) {
    return part + ((long long)blockIdx.x * T + k) * (2 * HS);
}

// The sum of the products of 8 bf16 pairs (a 16-byte load of each), in order: the chunk
// sums D's two kernels (attn_bwd_d8, the wgmma dQ pass: d_row_quad) start from.
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    float x[8], y[8];
    unpack8(a, x);
    unpack8(b, y);
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc = __fmaf_rn(x[k], y[k], acc);
    return acc;
}

// Every kernel entry point twice: plain (name_HS) and document-masked (name_HS_docs, `docs` last).
#define DOCS_PARAM_ , const unsigned* docs
