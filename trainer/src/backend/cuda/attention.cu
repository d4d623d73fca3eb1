// Causal self-attention, multi-head or grouped-query, flash style (twin of
// cpu/attention.rs, which computes the same function but keeps the whole [T, T]
// probability matrix).
//
// Nothing of size T x T is ever stored. Forward: one block per (query tile of 64,
// query head, batch) streams key/value tiles of 64 through shared memory with an online
// softmax, and saves only the per-row log-sum-exp (base 2) for backward. Backward
// recomputes the probabilities from q, k and that log-sum-exp, in two kernels so that
// nothing is accumulated with atomics (deterministic): one block per (key tile, key/value
// head) for dK and dV, one block per (query tile, query head) for dQ. D = rowsum(dO * O)
// comes first.
//
// Grouped-query attention (GQA): a row of qkv holds the NH query heads, then NKV key heads,
// then NKV value heads (row stride W = (NH + 2 NKV) HS; NKV divides NH, G = NH / NKV query
// heads per group); query head h reads key/value head h / G. Nothing is repeated in memory:
// the forward and dQ blocks read their query head's K/V head in place; a dK/dV block loops
// over its group's G query heads (every query tile of each, one head after the other) and
// accumulates the whole group's dK, dV in registers before one store, so a key/value head's
// gradient is a fixed-order sum, as without GQA. NKV = NH (G = 1) is multi-head attention
// with the same operations in the same order as before GQA (W = 3C).
//
// All arithmetic is fp32 (SIMT); q, k, v, dO are read as bf16 and widened in shared
// memory. Block = 256 threads as 16 x 16 (ty, tx): for a 64 x 64 score tile a thread
// owns rows ty + 16i and columns tx + 16j (i, j < 4); for a 64 x HS output tile it owns
// rows ty + 16i and the DPT = HS/16 contiguous columns tx*DPT... The strided rows and
// the padded row lengths (HS + 4 floats, an odd number of 16-byte words; 80 floats for
// score tiles) keep the shared-memory reads free of bank conflicts.

// Document-aware attention (data.document_mask; attention.rs: `AttnInputs::docs`):
// docs[b T + q] is the position in its sequence where row q's document starts, and query q
// attends the keys ds(q) <= k <= q. Within a sequence ds is non-decreasing (each value is
// the previous row's or the row's own position: checked on the host), so
// - a query tile's smallest start is its first row's: the forward and dQ blocks skip the
//   key tiles wholly below it (the first ds(q0) / 64), and a key tile needs the document
//   mask only where its first key is below the start of the tile's (or a thread's) last row;
// - the queries that attend key tile kt (keys k0..kl) are q in [k0, the end of kl's
//   document): query tile j >= kt takes part iff its first row's ds(64 j) <= kl, a prefix
//   of the tiles from kt on, which a dK/dV block counts (doc_query_tiles, doc_key_ends) and
//   loops over instead of every tile to T. Equivalently, query q attends key k iff
//   k <= q < end(k), end(k) the first row after k whose document starts after k: the
//   tensor-core dK/dV kernels mask with their keys' ends (in registers), the SIMT ones with
//   their queries' starts (in shared memory), the forward and dQ kernels with their rows'
//   starts.
// Every tiled kernel comes twice: DOCS = false is the plain causal kernel (the same code as
// before the option: the mask's code is compiled out), DOCS = true the masked one (entry
// points named *_docs, with `docs` as their last argument). A token always attends itself,
// so no row is ever fully masked; rows past T take the last row's start.

// TILE, NTHREADS and LDP come from attention.rs as -D options (the launch geometry and
// the shared-memory size computed there depend on them).

template <int HS> struct Geo {
    static constexpr int LD = HS + 4;
    static constexpr int DPT = HS / 16;
};

// Rows [0, 64) of a bf16 matrix (row r at base + r*stride) -> dst[64][HS+4] floats,
// multiplied by mul. Rows at or past nvalid are zero.
template <int HS>
__device__ __forceinline__ void load_tile(float* dst, const bf16_t* base, long long stride, int nvalid,
                                          float mul) {
    constexpr int CPR = HS / 8;  // 16-byte chunks per row
    constexpr int LD = Geo<HS>::LD;
    for (int c = threadIdx.x; c < TILE * CPR; c += NTHREADS) {
        const int r = c / CPR, ch = c % CPR;
        float f[8];
        if (r < nvalid) {
            unpack8(*(const uint4*)(base + (long long)r * stride + ch * 8), f);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] *= mul;
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = 0.f;
        }
        float4* d = (float4*)(dst + r * LD + ch * 8);
        d[0] = make_float4(f[0], f[1], f[2], f[3]);
        d[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

// acc[i][j] += A[ty+16i][:] . B[tx+16j][:]  (both [64][HS+4]).
template <int HS>
__device__ __forceinline__ void mm_abt(float acc[4][4], const float* A, const float* B, int ty, int tx) {
    constexpr int LD = Geo<HS>::LD;
#pragma unroll 4
    for (int d = 0; d < HS; d += 4) {
        float4 a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = *(const float4*)(A + (ty + 16 * i) * LD + d);
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = *(const float4*)(B + (tx + 16 * j) * LD + d);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float s = acc[i][j];
                s = fmaf(a[i].x, b[j].x, s);
                s = fmaf(a[i].y, b[j].y, s);
                s = fmaf(a[i].z, b[j].z, s);
                s = fmaf(a[i].w, b[j].w, s);
                acc[i][j] = s;
            }
    }
}

template <int DPT>
__device__ __forceinline__ void load_row(float* out, const float* p) {
    if (DPT % 4 == 0) {
#pragma unroll
        for (int k = 0; k < DPT; k += 4) {
            const float4 v = *(const float4*)(p + k);
            out[k] = v.x;
            out[k + 1] = v.y;
            out[k + 2] = v.z;
            out[k + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < DPT; k += 2) {
            const float2 v = *(const float2*)(p + k);
            out[k] = v.x;
            out[k + 1] = v.y;
        }
    }
}

// acc[i][:] += sum_r X(row = ty+16i, r) * Y[r][tx*DPT ...], X a [64][LDP] score tile.
// TRANS = false: X(row, r) = X[row][r]; TRANS = true: X(row, r) = X[r][row].
template <int HS, bool TRANS>
__device__ __forceinline__ void mm_xy(float acc[4][Geo<HS>::DPT], const float* X, const float* Y, int ty,
                                      int tx) {
    constexpr int LD = Geo<HS>::LD;
    constexpr int DPT = Geo<HS>::DPT;
#pragma unroll 4
    for (int r = 0; r < TILE; ++r) {
        float y[DPT];
        load_row<DPT>(y, Y + r * LD + tx * DPT);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float x = TRANS ? X[r * LDP + ty + 16 * i] : X[(ty + 16 * i) * LDP + r];
#pragma unroll
            for (int k = 0; k < DPT; ++k) acc[i][k] = fmaf(x, y[k], acc[i][k]);
        }
    }
}

// Reductions across the 16 tx lanes that share a ty (lanes 0-15 and 16-31 of a warp).
__device__ __forceinline__ float max16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float sum16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

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

// dK and dV of dqkv from a split dK/dV launch's partial sums, added in split order (the same
// bits on every run). Thread per 4 consecutive floats of a [B NKV][T][2 HS] row.
extern "C" __global__ void attn_dkv_reduce(bf16_t* dqkv, const float* part, int B, int T, int NH, int NKV,
                                           int HS, int S, float scale) {
    const long long n4 = (long long)B * NKV * T * (HS / 2);  // float4s: 2 HS / 4 per row
    const long long W = (long long)(NH + 2 * NKV) * HS;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n4;
         e += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(e % (HS / 2)) * 4;  // column in [dK | dV]
        const long long rk = e / (HS / 2);
        const int k = (int)(rk % T);
        const long long r = rk / T;  // b NKV + hk
        const int hk = (int)(r % NKV), b = (int)(r / NKV);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < S; ++s) {
            const float4 v = *(const float4*)(part + ((r * S + s) * T + k) * (2LL * HS) + c);
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        const bool dv = c >= HS;
        const float m = dv ? 1.f : scale;
        bf16_t* dst = dqkv + ((long long)b * T + k) * W + (NH + hk + (dv ? NKV : 0)) * HS + (dv ? c - HS : c);
        *(uint2*)dst = make_uint2((unsigned)f2bf(acc.x * m) | ((unsigned)f2bf(acc.y * m) << 16),
                                  (unsigned)f2bf(acc.z * m) | ((unsigned)f2bf(acc.w * m) << 16));
    }
}

// grid = (ceil(T/64), NH, B); dynamic smem = (3*64*LD + 64*LDP) floats.
// lse[b, h, t] = log2(sum_k exp2(s2)), s2 = q.k * scale * log2(e).
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_fwd_impl(bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH, int NKV,
                                              float scale, const unsigned* docs) {
    extern __shared__ float4 smem4[];
    constexpr int LD = Geo<HS>::LD, DPT = Geo<HS>::DPT;
    float* Qs = (float*)smem4;
    float* Ks = Qs + TILE * LD;
    float* Vs = Ks + TILE * LD;
    float* Ps = Vs + TILE * LD;
    const int nqt = gridDim.x;
    const int qt = nqt - 1 - blockIdx.x;  // longest rows first: better tail balance
    const int h = blockIdx.y, b = blockIdx.z;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const int q0 = qt * TILE;
    const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    load_tile<HS>(Qs, base + (long long)q0 * W, W, min(TILE, T - q0), scale * LOG2E_F);
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    float m[4], l[4], acc[4][DPT];
    int ds[4];  // this thread's rows' document starts
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -F_INF;
        l[i] = 0.f;
        ds[i] = doc_start<DOCS>(docs_b, q0 + ty + 16 * i, T);
#pragma unroll
        for (int k = 0; k < DPT; ++k) acc[i][k] = 0.f;
    }
    for (int kt = doc_first_tile<DOCS>(docs_b, q0, TILE); kt <= qt; ++kt) {
        const int k0 = kt * TILE;
        __syncthreads();  // the previous tile's readers of Ks, Vs, Ps are done
        load_tile<HS>(Ks, kbase + (long long)k0 * W, W, min(TILE, T - k0), 1.f);
        load_tile<HS>(Vs, vbase + (long long)k0 * W, W, min(TILE, T - k0), 1.f);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
        mm_abt<HS>(s, Qs, Ks, ty, tx);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = q0 + ty + 16 * i;
            float mx = -F_INF;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int k = k0 + tx + 16 * j;
                if (k > q || k >= T || (DOCS && k < ds[i])) s[i][j] = -F_INF;
                mx = fmaxf(mx, s[i][j]);
            }
            const float mnew = fmaxf(m[i], max16(mx));
            const float ref = mnew == -F_INF ? 0.f : mnew;
            const float alpha = exp2f(m[i] - ref);
            float rs = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[i][j] = exp2f(s[i][j] - ref);
                rs += s[i][j];
            }
            l[i] = l[i] * alpha + sum16(rs);
            m[i] = mnew;
#pragma unroll
            for (int k = 0; k < DPT; ++k) acc[i][k] *= alpha;
#pragma unroll
            for (int j = 0; j < 4; ++j) Ps[(ty + 16 * i) * LDP + tx + 16 * j] = s[i][j];
        }
        __syncthreads();
        mm_xy<HS, false>(acc, Ps, Vs, ty, tx);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = q0 + ty + 16 * i;
        if (q >= T) continue;
        const float inv = 1.f / l[i];
        bf16_t* o = out + ((long long)b * T + q) * C + h * HS + tx * DPT;
#pragma unroll
        for (int k = 0; k < DPT; ++k) o[k] = f2bf(acc[i][k] * inv);
        if (tx == 0) lse[((long long)b * NH + h) * T + q] = m[i] + log2f(l[i]);
    }
}

// D[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d]; one warp per (b, t, h).
extern "C" __global__ void attn_bwd_d(float* D, const bf16_t* dout, const bf16_t* out, int B, int T, int NH,
                                      int HS) {
    const long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= (long long)B * T * NH) return;
    const int h = (int)(r % NH);
    const long long bt = r / NH;
    const int b = (int)(bt / T), t = (int)(bt % T);
    const long long off = bt * NH * HS + h * HS;
    float acc = 0.f;
    for (int d = lane; d < HS; d += 32) acc += bf2f(dout[off + d]) * bf2f(out[off + d]);
    acc = warp_sum(acc);
    if (lane == 0) D[((long long)b * NH + h) * T + t] = acc;
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

// The same, HS / 8 threads a row (HS % 8 == 0, HS / 8 a power of two up to 32: attention.rs),
// each summing its 8 consecutive d of one 16-byte load of each (dO, O 16-byte aligned), then
// the row's threads' sums by shuffles within the warp, strides HS / 16 down to 1 (d_row_quad
// adds in this order too); the launch code's grid covers the rows.
extern "C" __global__ void attn_bwd_d8(float* D, const bf16_t* dout, const bf16_t* out, int B, int T, int NH,
                                       int HS) {
    const int per = HS / 8;
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long r = i / per, rows = (long long)B * T * NH;
    float acc = 0.f;
    if (r < rows) {
        const long long off = r * HS + 8 * (i % per);  // rows are (b, t, h) in order: [B, T, NH, HS]
        acc = dot8(*(const uint4*)(dout + off), *(const uint4*)(out + off));
    }
    for (int s = per / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (r < rows && i % per == 0) {
        const int h = (int)(r % NH);
        const long long bt = r / NH;
        D[((long long)(bt / T) * NH + h) * T + bt % T] = acc;
    }
}

// Loads, for query rows q0.., the scalars lse and D into shared arrays (0 past T), and
// with DOCS their document starts (docs_b: the batch's) into ds_s.
template <bool DOCS>
__device__ __forceinline__ void load_row_stats(float* lse_s, float* d_s, unsigned* ds_s, const float* lse,
                                               const float* D, const unsigned* docs_b, long long bh, int q0, int T) {
    if (threadIdx.x < TILE) {
        const int q = q0 + threadIdx.x;
        lse_s[threadIdx.x] = q < T ? lse[bh * T + q] : 0.f;
        d_s[threadIdx.x] = q < T ? D[bh * T + q] : 0.f;
        if (DOCS) ds_s[threadIdx.x] = (unsigned)doc_start<DOCS>(docs_b, q, T);
    }
}

// P and dS for one (query tile, key tile) pair, written into Ps (if non-null) and dSs; with
// DOCS, keys before a row's document start (ds_s) are masked.
template <int HS, bool DOCS>
__device__ __forceinline__ void probs_and_dscores(float* Ps, float* dSs, const float* Qs, const float* Ks,
                                                  const float* dOs, const float* Vs, const float* lse_s,
                                                  const float* d_s, const unsigned* ds_s, int q0, int k0, int T,
                                                  float sl2, int ty, int tx) {
    float s[4][4], dp[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            s[i][j] = 0.f;
            dp[i][j] = 0.f;
        }
    mm_abt<HS>(s, Qs, Ks, ty, tx);
    mm_abt<HS>(dp, dOs, Vs, ty, tx);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int qi = ty + 16 * i;
        const int q = q0 + qi;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int kj = tx + 16 * j;
            const int k = k0 + kj;
            const bool valid = k <= q && q < T && k < T && (!DOCS || k >= (int)ds_s[qi]);
            const float p = valid ? exp2f(s[i][j] * sl2 - lse_s[qi]) : 0.f;
            const float ds = p * (dp[i][j] - d_s[qi]);
            if (Ps) Ps[qi * LDP + kj] = p;
            dSs[qi * LDP + kj] = ds;
        }
    }
}

// Block per (key tile, key/value head) (grid: dkv_block); writes dK and dV of dqkv, or with
// S > 1 splits its fp32 partial sums (attn_dkv_reduce adds them up).
// dynamic smem = (4*64*LD + 2*64*LDP + 2*64) floats (+ 64 document starts with DOCS).
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_bwd_dkv_impl(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                                  const float* lse, const float* D, int T, int NH, int NKV,
                                                  float scale, float* part, int S, const unsigned* docs) {
    extern __shared__ float4 smem4[];
    constexpr int LD = Geo<HS>::LD, DPT = Geo<HS>::DPT;
    float* Ks = (float*)smem4;
    float* Vs = Ks + TILE * LD;
    float* Qs = Vs + TILE * LD;
    float* dOs = Qs + TILE * LD;
    float* Ps = dOs + TILE * LD;
    float* dSs = Ps + TILE * LDP;
    float* lse_s = dSs + TILE * LDP;
    float* d_s = lse_s + TILE;
    unsigned* ds_s = (unsigned*)(d_s + TILE);  // (DOCS only)
    const DkvBlock blk = dkv_block(NH, NKV, S);
    const int kt = blk.kt, hk = blk.hk, b = blk.b;  // small kt has the most query tiles: launched first
    const int nt = (T + TILE - 1) / TILE, G = NH / NKV;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* kbase = qkv + (long long)b * T * W + (NH + hk) * HS;
    const bf16_t* vbase = kbase + NKV * HS;
    const int k0 = kt * TILE;
    const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    const float sl2 = scale * LOG2E_F;
    load_tile<HS>(Ks, kbase + (long long)k0 * W, W, min(TILE, T - k0), 1.f);
    load_tile<HS>(Vs, vbase + (long long)k0 * W, W, min(TILE, T - k0), 1.f);
    float dk[4][DPT], dv[4][DPT];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < DPT; ++k) {
            dk[i][k] = 0.f;
            dv[i][k] = 0.f;
        }
    // This block's run of the group's (query head, query tile) pairs, i = g nq + qt - kt:
    // query head hk G + g, query tiles kt.. of each head in turn (nq of them: to T, or with
    // documents to the end of the tile's last key's).
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    const int nq = DOCS ? doc_query_tiles(docs_b, kt, nt, min(k0 + TILE - 1, T - 1)) : nt - kt;
    const int n = G * nq, i0 = blk.s * n / S, i1 = (blk.s + 1) * n / S;
    for (int i = i0; i < i1; ++i) {
        const int h = hk * G + i / nq, qt = kt + i % nq, q0 = qt * TILE;
        const long long bh = (long long)b * NH + h;
        const bf16_t* base = qkv + (long long)b * T * W + h * HS;
        const bf16_t* dobase = dout + (long long)b * T * C + h * HS;
        __syncthreads();
        load_tile<HS>(Qs, base + (long long)q0 * W, W, min(TILE, T - q0), 1.f);
        load_tile<HS>(dOs, dobase + (long long)q0 * C, C, min(TILE, T - q0), 1.f);
        load_row_stats<DOCS>(lse_s, d_s, ds_s, lse, D, docs_b, bh, q0, T);
        __syncthreads();
        probs_and_dscores<HS, DOCS>(Ps, dSs, Qs, Ks, dOs, Vs, lse_s, d_s, ds_s, q0, k0, T, sl2, ty, tx);
        __syncthreads();
        mm_xy<HS, true>(dv, Ps, dOs, ty, tx);   // dV[k] += sum_q P[q][k] dO[q]
        mm_xy<HS, true>(dk, dSs, Qs, ty, tx);   // dK[k] += sum_q dS[q][k] Q[q]
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int k = k0 + ty + 16 * i;
        if (k >= T) continue;
        if (S == 1) {
            bf16_t* row = dqkv + ((long long)b * T + k) * W + (NH + hk) * HS + tx * DPT;
#pragma unroll
            for (int d = 0; d < DPT; ++d) {
                row[d] = f2bf(dk[i][d] * scale);
                row[NKV * HS + d] = f2bf(dv[i][d]);
            }
        } else {
            float* row = dkv_part_row<HS>(part, T, k) + tx * DPT;
#pragma unroll
            for (int d = 0; d < DPT; ++d) {
                row[d] = dk[i][d];
                row[HS + d] = dv[i][d];
            }
        }
    }
}

// grid = (ceil(T/64), NH, B), block per (query tile, query head); writes dQ of dqkv.
// dynamic smem = (4*64*LD + 64*LDP + 2*64) floats (+ 64 document starts with DOCS).
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_bwd_dq_impl(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                                 const float* lse, const float* D, int T, int NH, int NKV,
                                                 float scale, const unsigned* docs) {
    extern __shared__ float4 smem4[];
    constexpr int LD = Geo<HS>::LD, DPT = Geo<HS>::DPT;
    float* Qs = (float*)smem4;
    float* dOs = Qs + TILE * LD;
    float* Ks = dOs + TILE * LD;
    float* Vs = Ks + TILE * LD;
    float* dSs = Vs + TILE * LD;
    float* lse_s = dSs + TILE * LDP;
    float* d_s = lse_s + TILE;
    unsigned* ds_s = (unsigned*)(d_s + TILE);  // (DOCS only)
    const int nt = gridDim.x;
    const int qt = nt - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const long long bh = (long long)b * NH + h;
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const bf16_t* dobase = dout + (long long)b * T * C + h * HS;
    const int q0 = qt * TILE;
    const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    const float sl2 = scale * LOG2E_F;
    load_tile<HS>(Qs, base + (long long)q0 * W, W, min(TILE, T - q0), 1.f);
    load_tile<HS>(dOs, dobase + (long long)q0 * C, C, min(TILE, T - q0), 1.f);
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    load_row_stats<DOCS>(lse_s, d_s, ds_s, lse, D, docs_b, bh, q0, T);
    float dq[4][DPT];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < DPT; ++k) dq[i][k] = 0.f;
    for (int kt = doc_first_tile<DOCS>(docs_b, q0, TILE); kt <= qt; ++kt) {
        const int k0 = kt * TILE;
        __syncthreads();
        load_tile<HS>(Ks, kbase + (long long)k0 * W, W, min(TILE, T - k0), 1.f);
        load_tile<HS>(Vs, vbase + (long long)k0 * W, W, min(TILE, T - k0), 1.f);
        __syncthreads();
        probs_and_dscores<HS, DOCS>(nullptr, dSs, Qs, Ks, dOs, Vs, lse_s, d_s, ds_s, q0, k0, T, sl2, ty, tx);
        __syncthreads();
        mm_xy<HS, false>(dq, dSs, Ks, ty, tx);  // dQ[q] += sum_k dS[q][k] K[k]
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = q0 + ty + 16 * i;
        if (q >= T) continue;
        bf16_t* row = dqkv + ((long long)b * T + q) * W + h * HS + tx * DPT;
#pragma unroll
        for (int d = 0; d < DPT; ++d) row[d] = f2bf(dq[i][d] * scale);
    }
}

#define ATTN_INSTANCES_(HS, SUF, DOCS, DOCS_PARAM, DOCS_ARG)                                                \
    extern "C" __global__ void __launch_bounds__(NTHREADS) attn_fwd_##HS##SUF(                                 \
        bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH, int NKV, float scale DOCS_PARAM) {         \
        attn_fwd_impl<HS, DOCS>(out, lse, qkv, T, NH, NKV, scale, DOCS_ARG);                                  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS)                                                    \
        attn_bwd_dkv_##HS##SUF(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse,         \
                               const float* D, int T, int NH, int NKV, float scale, float* part,              \
                               int S DOCS_PARAM) {                                                            \
        attn_bwd_dkv_impl<HS, DOCS>(dqkv, dout, qkv, lse, D, T, NH, NKV, scale, part, S, DOCS_ARG);           \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS)                                                    \
        attn_bwd_dq_##HS##SUF(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse,          \
                              const float* D, int T, int NH, int NKV, float scale DOCS_PARAM) {               \
        attn_bwd_dq_impl<HS, DOCS>(dqkv, dout, qkv, lse, D, T, NH, NKV, scale, DOCS_ARG);                     \
    }
// Every kernel entry point twice: plain (name_HS) and document-masked (name_HS_docs, `docs` last).
#define DOCS_PARAM_ , const unsigned* docs
#define ATTN_INSTANCES(HS)                                  \
    ATTN_INSTANCES_(HS, , false, , nullptr)                 \
    ATTN_INSTANCES_(HS, _docs, true, DOCS_PARAM_, docs)

// (The SIMT kernels need HS / 16 to be a multiple of 2 for their vector accesses: no 80, 96.)
ATTN_INSTANCES(32)
ATTN_INSTANCES(64)
ATTN_INSTANCES(128)

// ============================================================================
// Tensor-core path for head sizes 64, 80, 96 and 128 (GPT-2 sizes use 64; models from
// ~3B up use 128): the same three kernels with the products on mma.sync m16n8k16 (bf16
// in, fp32 accumulate), FlashAttention-2 style. Block = 4 warps; the backward kernels and
// the head-size-64 forward give each warp 16 rows of a 64-row tile, the forward at larger
// head sizes 32 rows of a 128-row tile (`FWD_MT`). q, k, v, dO stay bf16 in dynamic shared memory, rows padded to HS + 8
// elements (an odd number of 16-byte words: conflict-free ldmatrix rows). Probabilities
// and dS are rounded to bf16 only as mma operands; the softmax statistics, D and every
// accumulator are fp32.
//
// The streamed tiles are double-buffered with cp.async: the next tile's copy runs
// while the current one is multiplied. The block's own tile (Q in the forward and dQ
// kernels, K and V in dK/dV) is read into registers as mma A fragments where that fits
// (every head size in the forward, HS <= 64 in the backward kernels) and then borrows the
// second buffer's shared memory before the stream starts; at larger head sizes the
// backward kernels keep it in shared memory of its own and load its fragments per
// k-step (their accumulators, 2 x 16 x HS per warp, already take most registers). Only
// the diagonal (and a ragged last) tile pays for the causal mask.
//
// Shared memory is dynamic: attention.rs sizes it with the same tile counts as below
// (`mma_tiles`), and every kernel checks it got at least that much (a trap, not a
// silent overrun, if the two ever disagree).
//
// Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, "col"):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16x8):             c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// ============================================================================

template <int HS> struct Mg {
    static constexpr int LD = HS + 8;       // bf16 per shared row
    static constexpr int KS = HS / 16;      // mma k-steps over the head dimension
    static constexpr int NT = HS / 8;       // 8-wide n-tiles over the head dimension
    static constexpr int TE = 64 * LD;      // bf16 elements of one 64-row tile
    static constexpr bool OWN_IN_REGS = HS <= 64;  // backward kernels: own tile as A fragments
    // Forward: 16 FWD_MT query rows per warp (H200, T = 1024 and 2048: two m-tiles are up
    // to 14% faster at head sizes 80-128 and slower at 64, which keeps attn_fwd_mma16_impl),
    // kept as A fragments where they fit.
    static constexpr int FWD_MT = HS <= 64 ? 1 : 2;
    static constexpr bool FWD_Q_IN_REGS = FWD_MT == 1 || HS <= 80;
};

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Bytes of dynamic shared memory this launch got.
__device__ __forceinline__ unsigned dyn_smem_bytes() {
    unsigned r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Stop the kernel (a launch error the host sees) if the launch gave less shared memory
// than the kernel's tiles need.
__device__ __forceinline__ void require_smem(unsigned bytes) {
    if (dyn_smem_bytes() < bytes) __trap();
}

// Four 8x8 b16 matrices, transposed: r0..r3 as described at the call sites.
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Four 8x8 b16 matrices, not transposed: lanes 8m..8m+7 address the rows of matrix m.
__device__ __forceinline__ void ldsm_x4(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Two 8x8 b16 matrices, not transposed: lanes 0..7 and 8..15 address their rows.
__device__ __forceinline__ void ldsm_x2(unsigned* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// The A fragment (16 rows x k 16) of k-step kk of a 16 x 64 tile held as C-layout fp32
// registers (its n-tiles 2kk and 2kk + 1), rounded to bf16: how P or dS feeds the next
// product, with mma.sync and wgmma alike.
__device__ __forceinline__ void pack_afrag(unsigned a[4], const float P[8][4], int kk) {
    a[0] = pack2(P[2 * kk][0], P[2 * kk][1]);
    a[1] = pack2(P[2 * kk][2], P[2 * kk][3]);
    a[2] = pack2(P[2 * kk + 1][0], P[2 * kk + 1][1]);
    a[3] = pack2(P[2 * kk + 1][2], P[2 * kk + 1][3]);
}

// The A fragment of k-step kk (columns 16kk..) of rows r0..r0+15 of a [64][LD] tile:
// lanes 0-15 address rows r0.. at column 16kk, lanes 16-31 the same rows at 16kk + 8.
template <int HS>
__device__ __forceinline__ void afrag_step(unsigned a[4], const bf16_t* X, int r0, int kk) {
    const int lane = threadIdx.x & 31;
    ldsm_x4(a, X + (r0 + (lane & 15)) * Mg<HS>::LD + kk * 16 + (lane >> 4) * 8);
}

// Every k-step's A fragment of rows r0..r0+15 (kept in registers).
template <int HS>
__device__ __forceinline__ void load_afrag(unsigned a[][4], const bf16_t* X, int r0) {
#pragma unroll
    for (int kk = 0; kk < Mg<HS>::KS; ++kk) afrag_step<HS>(a[kk], X, r0, kk);
}

// acc[j] (16 x 64, 8 n-tiles) += A (16 x HS) * Y^T, Y a [64 n][LD] tile. A comes from
// registers (`a`, every k-step) or, when `a` is null, from rows r0.. of the tile X,
// a pair of k-steps at a time. One ldmatrix.x4 gives the B fragments of two k-steps:
// matrix m = rows j*8.., columns 32h + 8m.. (b0, b1 of k-step 2h, then of 2h+1).
template <int HS>
__device__ __forceinline__ void mma_abt(float acc[8][4], const unsigned (*a)[4], const bf16_t* X, int r0,
                                        const bf16_t* Y) {
    constexpr int LD = Mg<HS>::LD, KS = Mg<HS>::KS;
    const int lane = threadIdx.x & 31;
    const bf16_t* base = Y + (lane & 7) * LD + (lane >> 3) * 8;
#pragma unroll
    for (int h = 0; h < KS / 2; ++h) {
        unsigned ta[2][4];
        const unsigned* a0 = a ? a[2 * h] : ta[0];
        const unsigned* a1 = a ? a[2 * h + 1] : ta[1];
        if (!a) {
            afrag_step<HS>(ta[0], X, r0, 2 * h);
            afrag_step<HS>(ta[1], X, r0, 2 * h + 1);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            unsigned r[4];
            ldsm_x4(r, base + j * 8 * LD + h * 32);
            mma_bf16(acc[j], a0, r[0], r[1]);
            mma_bf16(acc[j], a1, r[2], r[3]);
        }
    }
    if constexpr (KS % 2 == 1) {
        unsigned ta[4];
        const unsigned* al = a ? a[KS - 1] : ta;
        if (!a) afrag_step<HS>(ta, X, r0, KS - 1);
        const bf16_t* base2 = Y + (lane & 7) * LD + ((lane >> 3) & 1) * 8 + (KS - 1) * 16;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            unsigned r[2];
            ldsm_x2(r, base2 + j * 8 * LD);
            mma_bf16(acc[j], al, r[0], r[1]);
        }
    }
}

// cp.async: 64 rows x HS bf16 (row r at src + r*stride) -> dst[64][LD]; rows >= nvalid
// are zero-filled (source size 0). 128 threads, 16-byte chunks. Not complete until
// cp_wait and a barrier.
template <int HS>
__device__ __forceinline__ void load_tile16_async(bf16_t* dst, const bf16_t* src, long long stride, int nvalid) {
    constexpr int CPR = HS / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < 64 * CPR; c += 128) {
        const int r = c / CPR, ch = c % CPR;
        const bool ok = r < nvalid;
        const bf16_t* g = src + (long long)(ok ? r : 0) * stride + ch * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst + r * Mg<HS>::LD + ch * 8)),
                     "l"(g), "r"(ok ? 16 : 0));
    }
}

// cp.async of 64 4-byte values v[i0 + i] (0 where i0 + i >= n) into dst, by threads
// first..first+63.
template <typename E>
__device__ __forceinline__ void load_row64_async(E* dst, const E* v, int i0, int n, int first) {
    const int i = threadIdx.x - first;
    if (i < 0 || i >= 64) return;
    const bool ok = i0 + i < n;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst + i)), "l"(v + (ok ? i0 + i : 0)),
                 "r"(ok ? 4 : 0));
}

// acc[j] (16 x HS, NT n-tiles) += P (16 x 64, C-layout fp32 registers) * Z, Z a [64 k][LD] tile.
template <int HS>
__device__ __forceinline__ void mma_pz(float acc[][4], const float P[8][4], const bf16_t* Z) {
    constexpr int LD = Mg<HS>::LD;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        unsigned a[4];
        pack_afrag(a, P, kk);
        const int row = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int jp = 0; jp < Mg<HS>::NT / 2; ++jp) {
            // r0, r1: B of n-tile 2jp (k rows 0-7, 8-15); r2, r3: of n-tile 2jp+1.
            unsigned r[4];
            ldsm_x4_trans(r, Z + row * LD + 16 * jp + (lane >> 4) * 8);
            mma_bf16(acc[2 * jp], a, r[0], r[1]);
            mma_bf16(acc[2 * jp + 1], a, r[2], r[3]);
        }
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int N>
__device__ __forceinline__ void zero_acc(float x[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = 0.f;
}

// One step of the key/value stream of the forward and dQ kernels: once every thread is
// done with the other buffer (it held tile kt - 1), start copying key tile `k1` (if
// k1 >= 0) into it, then wait until tile kt (copied one step earlier) has landed.
// kbase: the key head's first row (row stride W), its value head voff after it.
template <int HS>
__device__ __forceinline__ void next_kv_tile(bf16_t* Kn, bf16_t* Vn, const bf16_t* kbase, int voff, long long W,
                                             int k1, int T) {
    __syncthreads();
    if (k1 >= 0) {
        const bf16_t* k = kbase + (long long)k1 * W;
        load_tile16_async<HS>(Kn, k, W, min(64, T - k1));
        load_tile16_async<HS>(Vn, k + voff, W, min(64, T - k1));
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
}

// 2^x on the special-function unit, flushing denormals: exp2f without fast math wraps
// the same instruction in a range fix-up the softmax does not need (its results either
// matter at fp32/bf16 precision or are rounded to zero anyway).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// acc[mi][j] (MT m-tiles: 16 MT rows x 64 keys) += A (16 MT x HS) * Y^T, Y a [64 n][LD]
// tile. A is rows 0.. of X (row stride LD), as fragments in registers (`qa`, QREGS) or
// read from X a pair of k-steps at a time. Every B fragment (one ldmatrix.x4: two k-steps
// of an n-tile) feeds 2 MT mma: with MT = 2, half the shared-memory reads per product.
template <int HS, int MT, bool QREGS>
__device__ __forceinline__ void mma_abt_mt(float acc[MT][8][4], const unsigned (*qa)[QREGS ? Mg<HS>::KS : 1][4],
                                           const bf16_t* X, const bf16_t* Y) {
    constexpr int LD = Mg<HS>::LD, KS = Mg<HS>::KS;
    const int lane = threadIdx.x & 31;
    const bf16_t* base = Y + (lane & 7) * LD + (lane >> 3) * 8;
#pragma unroll
    for (int h = 0; h < KS / 2; ++h) {
        unsigned ta[MT][2][4];
        const unsigned* a[MT][2];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                if constexpr (QREGS) {
                    a[mi][s] = qa[mi][2 * h + s];
                } else {
                    afrag_step<HS>(ta[mi][s], X, 16 * mi, 2 * h + s);
                    a[mi][s] = ta[mi][s];
                }
            }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            unsigned r[4];
            ldsm_x4(r, base + j * 8 * LD + h * 32);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) mma_bf16(acc[mi][j], a[mi][0], r[0], r[1]);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) mma_bf16(acc[mi][j], a[mi][1], r[2], r[3]);
        }
    }
    if constexpr (KS % 2 == 1) {
        unsigned ta[MT][4];
        const unsigned* a[MT];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            if constexpr (QREGS) {
                a[mi] = qa[mi][KS - 1];
            } else {
                afrag_step<HS>(ta[mi], X, 16 * mi, KS - 1);
                a[mi] = ta[mi];
            }
        }
        const bf16_t* base2 = Y + (lane & 7) * LD + ((lane >> 3) & 1) * 8 + (KS - 1) * 16;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            unsigned r[2];
            ldsm_x2(r, base2 + j * 8 * LD);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) mma_bf16(acc[mi][j], a[mi], r[0], r[1]);
        }
    }
}

// acc[mi][j] (16 MT x HS) += P (16 MT x 64, MT m-tiles of C-layout fp32 registers) * Z, Z
// a [64 k][LD] tile; each transposed B fragment feeds every m-tile.
template <int HS, int MT>
__device__ __forceinline__ void mma_pz_mt(float acc[MT][Mg<HS>::NT][4], const float P[MT][8][4], const bf16_t* Z) {
    constexpr int LD = Mg<HS>::LD;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) pack_afrag(a[mi], P[mi], kk);
        const int row = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int jp = 0; jp < Mg<HS>::NT / 2; ++jp) {
            unsigned r[4];
            ldsm_x4_trans(r, Z + row * LD + 16 * jp + (lane >> 4) * 8);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) mma_bf16(acc[mi][2 * jp], a[mi], r[0], r[1]);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) mma_bf16(acc[mi][2 * jp + 1], a[mi], r[2], r[3]);
        }
    }
}

// Which scores of a 16 x 64 tile of the one-m-tile forward are masked: this thread's rows
// qrow and qrow + 8 against keys k0 + 8j + 2t (+1); only an edge tile (crossing the
// diagonal or T, or with documents a row's start) is masked at all. ds0, ds1: the two
// rows' document starts (read with DOCS only).
struct TileMask {
    int qrow, k0, t, T;
    bool edge;
    int ds0, ds1;
};

// One key tile of the one-m-tile forward's online softmax (the mma.sync and the wgmma
// kernels: their accumulator layouts agree), in two steps so that the wgmma forward can run
// the first while the previous tile's P V is still accumulating into o. softmax_probs: s
// (16 x 64 scores, C layout) becomes the tile's probabilities against the new running max m
// (base 2, scaled by sl2), the running sum l is rescaled to it and gains the tile's sum;
// returns the factor (alpha) by which the output accumulator must be rescaled, which
// rescale_acc applies.
template <bool DOCS>
__device__ __forceinline__ void softmax_probs(float s[8][4], float m[2], float l[2], float alpha[2], TileMask mk,
                                              float sl2) {
    const int qrow = mk.qrow, k0 = mk.k0, t = mk.t, T = mk.T;
    const bool edge = mk.edge;
    float mx[2] = {-F_INF, -F_INF};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1, q = qrow + 8 * r, k = k0 + j * 8 + 2 * t + (e & 1);
            float v = s[j][e] * sl2;
            if (edge && (k > q || k >= T || (DOCS && k < (r ? mk.ds1 : mk.ds0)))) v = -F_INF;
            s[j][e] = v;
            mx[r] = fmaxf(mx[r], v);
        }
    float ref[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float mnew = fmaxf(m[r], quad_max(mx[r]));
        ref[r] = mnew == -F_INF ? 0.f : mnew;
        alpha[r] = ex2(m[r] - ref[r]);
        m[r] = mnew;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = ex2(s[j][e] - ref[e >> 1]);
            s[j][e] = p;
            rs[e >> 1] += p;
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + quad_sum(rs[r]);
}
template <int NT>
__device__ __forceinline__ void rescale_acc(float o[NT][4], const float alpha[2]) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
    }
}
template <int NT, bool DOCS>
__device__ __forceinline__ void softmax_tile(float s[8][4], float o[NT][4], float m[2], float l[2], TileMask mk,
                                             float sl2) {
    float alpha[2];
    softmax_probs<DOCS>(s, m, l, alpha, mk, sl2);
    rescale_acc<NT>(o, alpha);
}

// The backward's element-wise step between its products, shared by the mma.sync and the
// wgmma kernels (their accumulator layouts agree: 16 rows per warp, C layout). Probabilities
// are recomputed from the saved log-sum-exp (base 2); a score outside the causal triangle or
// past T (only on an edge tile) gives p = 0.
//
// dK/dV block, transposed tiles (rows = keys krow, krow + 8; columns = the query tile at q0):
// st becomes P^T, dpt becomes dS^T = P^T (dP^T - D). ls, ds: the query tile's lse and D;
// ke (DOCS): the key tile's documents' ends (doc_key_ends), k0 its first key.
template <bool DOCS>
__device__ __forceinline__ void dkv_dscores(float st[8][4], float dpt[8][4], int krow, int q0, int t, int T,
                                            bool edge, const float* ls, const float* ds, const int* ke, int k0,
                                            float sl2) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k = krow + 8 * (e >> 1), qi = j * 8 + 2 * t + (e & 1), q = q0 + qi;
            const bool valid = !edge || (k <= q && q < T && k < T && (!DOCS || q < ke[k - k0]));
            const float p = valid ? ex2(fmaf(st[j][e], sl2, -ls[qi])) : 0.f;
            st[j][e] = p;
            dpt[j][e] = p * (dpt[j][e] - ds[qi]);
        }
}
// dQ block (rows = queries qrow, qrow + 8; columns = the key tile at k0): s becomes
// dS = P (dP - D). lr, dr: this thread's two rows' lse and D; dsr (DOCS): their document
// starts, dsr[0] and dsr[8] (in shared memory).
template <bool DOCS>
__device__ __forceinline__ void dq_dscores(float s[8][4], const float dp[8][4], int qrow, int k0, int t, int T,
                                           bool edge, const float lr[2], const float dr[2], const int* dsr,
                                           float sl2) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1, q = qrow + 8 * r, k = k0 + j * 8 + 2 * t + (e & 1);
            const bool valid = !edge || (k <= q && q < T && k < T && (!DOCS || k >= dsr[8 * r]));
            const float p = valid ? ex2(fmaf(s[j][e], sl2, -lr[r])) : 0.f;
            s[j][e] = p * (dp[j][e] - dr[r]);
        }
}

// Forward with one m-tile (16 query rows) per warp, for head size 64 (`FWD_MT` = 1).
// grid = (ceil(T/64), NH, B), 128 threads, 4 tiles of shared memory. The same function
// as attn_fwd_mma_impl below with MT = 1, kept as its own kernel because it is faster:
// 0.179 against 0.193 ms at GPT-2 124M shapes on an H200 (the two-m-tile kernel's
// register layout costs the one-m-tile case 7%; reordering its softmax did not recover
// it).
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_fwd_mma16_impl(bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH,
                                                    int NKV, float scale, const unsigned* docs) {
    using G = Mg<HS>;
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem(4 * G::TE * 2);
    // Buffer i of the key (value) stream: Ks + i * TE (Vs + i * TE); arithmetic, not an
    // array of pointers, which would live in local memory.
    bf16_t* const Ks = smem_mma;
    bf16_t* const Vs = smem_mma + 2 * G::TE;
    const int nqt = gridDim.x, qt = nqt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const int q0 = qt * 64, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // The first key tile kt0 (0, or with documents the first row's document's) is in buffer
    // kt0 % 2 (key tile kt in kt % 2); Q borrows the other (first used by key tile kt0 + 1,
    // loaded after the fragments are read).
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    const int kt0 = doc_first_tile<DOCS>(docs_b, q0, 64), kf = kt0 * 64, c0 = kt0 & 1;
    load_tile16_async<HS>(Ks + (c0 ^ 1) * G::TE, base + (long long)q0 * W, W, min(64, T - q0));
    load_tile16_async<HS>(Ks + c0 * G::TE, kbase + (long long)kf * W, W, min(64, T - kf));
    load_tile16_async<HS>(Vs + c0 * G::TE, vbase + (long long)kf * W, W, min(64, T - kf));
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    unsigned qa[G::KS][4];
    load_afrag<HS>(qa, Ks + (c0 ^ 1) * G::TE, warp * 16);
    float o[G::NT][4];
    zero_acc<G::NT>(o);
    float m[2] = {-F_INF, -F_INF}, l[2] = {0.f, 0.f};
    const int qrow = q0 + warp * 16 + g;  // this thread's rows: qrow, qrow + 8
    const int ds0 = doc_start<DOCS>(docs_b, qrow, T), ds1 = doc_start<DOCS>(docs_b, qrow + 8, T);
    for (int kt = kt0; kt <= qt; ++kt) {
        const int k0 = kt * 64, cur = kt & 1;
        // (the Q copy in the other buffer counts as tile kt0 - 1)
        next_kv_tile<HS>(Ks + (cur ^ 1) * G::TE, Vs + (cur ^ 1) * G::TE, kbase, NKV * HS, W, kt < qt ? k0 + 64 : -1, T);
        float s[8][4];
        zero_acc<8>(s);
        mma_abt<HS>(s, qa, nullptr, 0, Ks + cur * G::TE);
        const bool edge = kt == qt || k0 + 64 > T || (DOCS && k0 < ds1);
        softmax_tile<G::NT, DOCS>(s, o, m, l, TileMask{qrow, k0, t, T, edge, ds0, ds1}, sl2);
        mma_pz<HS>(o, s, Vs + cur * G::TE);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = qrow + 8 * r;
        if (q >= T) continue;
        const float inv = 1.f / l[r];
        bf16_t* dst = out + ((long long)b * T + q) * C + h * HS + 2 * t;
#pragma unroll
        for (int j = 0; j < G::NT; ++j) *(unsigned*)(dst + j * 8) = pack2(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
        if (t == 0) lse[((long long)b * NH + h) * T + q] = m[r] + log2f(l[r]);
    }
}

// Forward. grid = (ceil(T / (64 MT)), NH, B), 128 threads: a block per 64 MT query
// rows, each warp 16 MT of them (MT = 2 is FlashAttention-2's layout: half the
// shared-memory reads per product, but fewer blocks fit an SM; `FWD_MT` picks per head
// size, as measured), key/value tiles of 64 double-buffered. Shared memory: 4 tiles (K, V
// x 2), and Q's MT tiles of its own where its fragments do not fit in registers
// (`FWD_Q_IN_REGS`); otherwise Q borrows the K (and V) buffers the first key tile does not
// use, which the next key tile first refills after every warp has read Q. A warp skips the
// key tiles wholly after its last row (and, within documents, wholly before its first row's
// document); only tiles that cross its diagonal (or T, or a document start) pay for the
// mask. Row sums stay per thread until the end (the rescaling is the same for the four
// threads of a row).
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_fwd_mma_impl(bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH,
                                                  int NKV, float scale, const unsigned* docs) {
    using G = Mg<HS>;
    constexpr int MT = G::FWD_MT, ROWS = 64 * MT, WR = 16 * MT;
    constexpr bool QREGS = G::FWD_Q_IN_REGS;
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem((QREGS ? 4 : 4 + MT) * G::TE * 2);
    bf16_t* const Ks = smem_mma;
    bf16_t* const Vs = smem_mma + 2 * G::TE;
    const int nqt = gridDim.x, qt = nqt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const int q0 = qt * ROWS, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // (DOCS) the block's rows' document starts, read only where a tile needs them (in shared
    // memory: at head sizes 96 and 128 this kernel has no registers to spare). The first key
    // tile kt0 (0, or with documents the first row's document's) is in buffer kt0 % 2 (key
    // tile kt in kt % 2); Q, where it goes to registers, borrows the other.
    __shared__ int ds_q[DOCS ? ROWS : 1];
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    if (DOCS && threadIdx.x < ROWS) ds_q[threadIdx.x] = doc_start<DOCS>(docs_b, q0 + threadIdx.x, T);
    const int kt0 = doc_first_tile<DOCS>(docs_b, q0, 64), kf = kt0 * 64, c0 = kt0 & 1;
    bf16_t* const Qlo = QREGS ? Ks + (c0 ^ 1) * G::TE : smem_mma + 4 * G::TE;  // query rows 0-63
    bf16_t* const Qhi = QREGS ? Vs + (c0 ^ 1) * G::TE : smem_mma + 5 * G::TE;  // query rows 64-127 (MT = 2)
    load_tile16_async<HS>(Qlo, base + (long long)q0 * W, W, min(64, T - q0));
    if constexpr (MT == 2) {
        // (rows past T are zero-filled without being read; the address stays inside the batch)
        load_tile16_async<HS>(Qhi, base + (long long)min(q0 + 64, T - 1) * W, W, min(64, T - q0 - 64));
    }
    load_tile16_async<HS>(Ks + c0 * G::TE, kbase + (long long)kf * W, W, min(64, T - kf));
    load_tile16_async<HS>(Vs + c0 * G::TE, vbase + (long long)kf * W, W, min(64, T - kf));
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    const int wq = warp * WR;  // this warp's first row in the block
    const bf16_t* const Qw = (wq < 64 ? Qlo : Qhi) + (wq & 63) * G::LD;
    unsigned qa[MT][QREGS ? G::KS : 1][4];
    if constexpr (QREGS) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) load_afrag<HS>(qa[mi], Qw, 16 * mi);
    }
    float o[MT][G::NT][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
        zero_acc<G::NT>(o[mi]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m[mi][r] = -F_INF;
            l[mi][r] = 0.f;
        }
    }
    const int qw0 = q0 + wq;  // this thread's rows: qw0 + 16 mi + 8 r + g
    const int nkt = min((T + 63) / 64, (q0 + ROWS - 1) / 64 + 1);
    for (int kt = kt0; kt < nkt; ++kt) {
        const int k0 = kt * 64, cur = kt & 1;
        // (with Q in registers, its copy in the other buffers counts as tile kt0 - 1). The key
        // head's address is recomputed from the block index each tile rather than kept: at head
        // sizes 96 and 128 this kernel is at 255 registers, and a pointer kept through the loop
        // spilled more (kernel_resources.py).
        const bf16_t* kb = kv_head<HS>(qkv, ctaid_z(), T, NH, NKV, ctaid_y());
        next_kv_tile<HS>(Ks + (cur ^ 1) * G::TE, Vs + (cur ^ 1) * G::TE, kb, NKV * HS, W, kt + 1 < nkt ? k0 + 64 : -1, T);
        if (k0 > qw0 + WR - 1) continue;  // warp-uniform: every key is after every row of this warp
        if (DOCS && k0 + 63 < ds_q[wq]) continue;  // every key is before every row's document
        float s[MT][8][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) zero_acc<8>(s[mi]);
        mma_abt_mt<HS, MT, QREGS>(s, qa, Qw, Ks + cur * G::TE);
        const bool edge = k0 + 63 > qw0 || k0 + 64 > T || (DOCS && k0 < ds_q[wq + WR - 1]);
        float mx[MT][2];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) mx[mi][r] = -F_INF;
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1, q = qw0 + 16 * mi + 8 * r + g, k = k0 + j * 8 + 2 * t + (e & 1);
                    if (edge && (k > q || k >= T || (DOCS && k < ds_q[q - q0]))) s[mi][j][e] = -F_INF;
                    mx[mi][r] = fmaxf(mx[mi][r], s[mi][j][e]);
                }
        // Statistics in base-2 units of the scaled score (scale > 0: the max commutes).
        float nref[MT][2];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float mnew = fmaxf(m[mi][r], quad_max(mx[mi][r]) * sl2);
                const float ref = mnew == -F_INF ? 0.f : mnew;
                const float alpha = ex2(m[mi][r] - ref);
                m[mi][r] = mnew;
                nref[mi][r] = -ref;
                l[mi][r] *= alpha;
#pragma unroll
                for (int j = 0; j < G::NT; ++j) {
                    o[mi][j][2 * r] *= alpha;
                    o[mi][j][2 * r + 1] *= alpha;
                }
            }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = ex2(fmaf(s[mi][j][e], sl2, nref[mi][e >> 1]));
                    s[mi][j][e] = p;
                    l[mi][e >> 1] += p;
                }
        mma_pz_mt<HS, MT>(o, s, Vs + cur * G::TE);
    }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int q = qw0 + 16 * mi + 8 * r + g;
            const float lt = quad_sum(l[mi][r]);
            if (q >= T) continue;
            const float inv = 1.f / lt;
            // (b and h read again: see the key head above)
            bf16_t* dst = out + ((long long)ctaid_z() * T + q) * (NH * HS) + ctaid_y() * HS + 2 * t;
#pragma unroll
            for (int j = 0; j < G::NT; ++j)
                *(unsigned*)(dst + j * 8) = pack2(o[mi][j][2 * r] * inv, o[mi][j][2 * r + 1] * inv);
            if (t == 0) lse[((long long)ctaid_z() * NH + ctaid_y()) * T + q] = m[mi][r] + log2f(lt);
        }
}

// dK, dV of dqkv: block per (key tile, key/value head) (grid: dkv_block), 128 threads. The
// group's query tiles (each query head's tiles kt.. in turn, or split s's run of them) stream
// through shared memory, double-buffered with their dO, lse and D: the pipeline runs on from
// one query head into the next. K and V stay for the whole run, in registers where their
// fragments fit, otherwise in tiles of their own. With S > 1, fp32 partial sums
// (attn_dkv_reduce adds them up).
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_bwd_dkv_mma_impl(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                                      const float* lse, const float* D, int T, int NH, int NKV,
                                                      float scale, float* part, int S, const unsigned* docs) {
    using G = Mg<HS>;
    constexpr bool REGS = G::OWN_IN_REGS;
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem((REGS ? 4 : 6) * G::TE * 2);
    __shared__ __align__(16) float lse_s[2][64], d_s[2][64];
    __shared__ int ke[DOCS ? 64 : 1], nq_s[1];  // (DOCS: doc_key_ends)
    __shared__ unsigned starts[2];
    // Buffer i of the query (dO) stream: Qs + i * TE (dOs + i * TE).
    bf16_t* const Qs = smem_mma;
    bf16_t* const dOs = smem_mma + 2 * G::TE;
    // K and V: borrow buffer 1 and go to registers, or stay in shared memory.
    bf16_t* const Kt = REGS ? Qs + G::TE : smem_mma + 4 * G::TE;
    bf16_t* const Vt = REGS ? dOs + G::TE : smem_mma + 5 * G::TE;
    const DkvBlock blk = dkv_block(NH, NKV, S);
    const int kt = blk.kt, hk = blk.hk, b = blk.b, nt = (T + 63) / 64, grp = NH / NKV;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* kbase = qkv + (long long)b * T * W + (NH + hk) * HS;
    const int k0 = kt * 64, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // The block's run of (query head, query tile) pairs, i in [i0, i1), i = j nq + qt - kt for
    // query head hk grp + j: (h, qt) is the pair to load next. nq query tiles from kt: to T,
    // or with documents to the end of the document of the tile's last key (nq_s; ke: the
    // keys' documents' ends).
    if (DOCS) {
        doc_key_ends(docs + (long long)b * T, kt, nt, T, ke, nq_s, starts);
        __syncthreads();
    }
    const int nq = DOCS ? nq_s[0] : nt - kt;
    const int n = grp * nq, i0 = blk.s * n / S, i1 = (blk.s + 1) * n / S;
    int qt = kt + i0 % nq, h = hk * grp + i0 / nq;
    // Query tile qt of head h into buffer c.
    auto load_q = [&](int c) {
        const int q1 = qt * 64;
        const long long row = (long long)b * T + q1, bh = (long long)b * NH + h;
        load_tile16_async<HS>(Qs + c * G::TE, qkv + row * W + h * HS, W, min(64, T - q1));
        load_tile16_async<HS>(dOs + c * G::TE, dout + row * C + h * HS, C, min(64, T - q1));
        load_row64_async(lse_s[c], lse + bh * T, q1, T, 0);
        load_row64_async(d_s[c], D + bh * T, q1, T, 64);
    };
    load_tile16_async<HS>(Kt, kbase + (long long)k0 * W, W, min(64, T - k0));
    load_tile16_async<HS>(Vt, kbase + NKV * HS + (long long)k0 * W, W, min(64, T - k0));
    load_q(0);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    unsigned ka[REGS ? G::KS : 1][4], va[REGS ? G::KS : 1][4];
    if constexpr (REGS) {
        load_afrag<HS>(ka, Kt, warp * 16);
        load_afrag<HS>(va, Vt, warp * 16);
    }
    float dk[G::NT][4], dv[G::NT][4];
    zero_acc<G::NT>(dk);
    zero_acc<G::NT>(dv);
    const int krow = k0 + warp * 16 + g;  // this thread's keys: krow, krow + 8
    for (int it = 0; it < i1 - i0; ++it) {
        const int q0 = qt * 64, cur = it & 1;
        // (DOCS) a query of the tile at or after the end of this thread's first key's document
        const bool edge = qt == kt || q0 + 64 > T || k0 + 64 > T || (DOCS && q0 + 63 >= ke[krow - k0]);
        // the next pair: this head's next query tile, or the next head's first
        if (++qt == (DOCS ? kt + nq_s[0] : nt)) {
            qt = kt;
            ++h;
        }
        __syncthreads();  // buffer cur ^ 1 (K/V copy or the previous query tile) is no longer read
        if (it + 1 < i1 - i0) load_q(cur ^ 1);
        cp_commit();
        cp_wait<1>();
        __syncthreads();  // query tile qt is in buffer cur
        float st[8][4], dpt[8][4];  // S^T and dP^T: rows = keys, columns = queries
        zero_acc<8>(st);
        zero_acc<8>(dpt);
        const bf16_t* Qc = Qs + cur * G::TE;
        const bf16_t* dOc = dOs + cur * G::TE;
        mma_abt<HS>(st, REGS ? ka : nullptr, Kt, warp * 16, Qc);
        mma_abt<HS>(dpt, REGS ? va : nullptr, Vt, warp * 16, dOc);
        const float* ls = lse_s[cur];
        const float* ds = d_s[cur];
        dkv_dscores<DOCS>(st, dpt, krow, q0, t, T, edge, ls, ds, ke, k0, sl2);
        mma_pz<HS>(dv, st, dOc);  // dV += P^T dO
        mma_pz<HS>(dk, dpt, Qc);   // dK += dS^T Q
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int k = krow + 8 * r;
        if (k >= T) continue;
        if (S == 1) {
            bf16_t* row = dqkv + ((long long)b * T + k) * W + (NH + hk) * HS + 2 * t;
#pragma unroll
            for (int j = 0; j < G::NT; ++j) {
                *(unsigned*)(row + j * 8) = pack2(dk[j][2 * r] * scale, dk[j][2 * r + 1] * scale);
                *(unsigned*)(row + NKV * HS + j * 8) = pack2(dv[j][2 * r], dv[j][2 * r + 1]);
            }
        } else {
            float* row = dkv_part_row<HS>(part, T, k) + 2 * t;
#pragma unroll
            for (int j = 0; j < G::NT; ++j) {
                *(float2*)(row + j * 8) = make_float2(dk[j][2 * r], dk[j][2 * r + 1]);
                *(float2*)(row + HS + j * 8) = make_float2(dv[j][2 * r], dv[j][2 * r + 1]);
            }
        }
    }
}

// dQ of dqkv. grid = (ceil(T/64), NH, B), 128 threads, block per (query tile, query head);
// shared memory: key and value tiles double-buffered, plus Q and dO of their own where their
// fragments do not live in registers.
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_bwd_dq_mma_impl(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                                     const float* lse, const float* D, int T, int NH, int NKV,
                                                     float scale, const unsigned* docs) {
    using G = Mg<HS>;
    constexpr bool REGS = G::OWN_IN_REGS;
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem((REGS ? 4 : 6) * G::TE * 2);
    bf16_t* const Ks = smem_mma;
    bf16_t* const Vs = smem_mma + 2 * G::TE;
    const int nt = gridDim.x, qt = nt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const long long bh = (long long)b * NH + h;
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const bf16_t* dobase = dout + (long long)b * T * C + h * HS;
    const int q0 = qt * 64, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // The first key tile kt0 (0, or with documents the first row's document's) is in buffer
    // kt0 % 2 (key tile kt in kt % 2); Q and dO, where they go to registers, borrow the other.
    // (DOCS) The rows' document starts in shared memory, read only where a tile needs them.
    __shared__ int ds_q[DOCS ? 64 : 1];
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    if (DOCS && threadIdx.x < 64) ds_q[threadIdx.x] = doc_start<DOCS>(docs_b, q0 + threadIdx.x, T);
    const int kt0 = doc_first_tile<DOCS>(docs_b, q0, 64), kf = kt0 * 64, c0 = kt0 & 1;
    bf16_t* const Qt = REGS ? Ks + (c0 ^ 1) * G::TE : smem_mma + 4 * G::TE;
    bf16_t* const dOt = REGS ? Vs + (c0 ^ 1) * G::TE : smem_mma + 5 * G::TE;
    load_tile16_async<HS>(Qt, base + (long long)q0 * W, W, min(64, T - q0));
    load_tile16_async<HS>(dOt, dobase + (long long)q0 * C, C, min(64, T - q0));
    load_tile16_async<HS>(Ks + c0 * G::TE, kbase + (long long)kf * W, W, min(64, T - kf));
    load_tile16_async<HS>(Vs + c0 * G::TE, vbase + (long long)kf * W, W, min(64, T - kf));
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    unsigned qa[REGS ? G::KS : 1][4], oa[REGS ? G::KS : 1][4];
    if constexpr (REGS) {
        load_afrag<HS>(qa, Qt, warp * 16);
        load_afrag<HS>(oa, dOt, warp * 16);
    }
    const int qrow = q0 + warp * 16 + g;  // this thread's rows: qrow, qrow + 8
    float lr[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = qrow + 8 * r;
        lr[r] = q < T ? lse[bh * T + q] : 0.f;
        dr[r] = q < T ? D[bh * T + q] : 0.f;
    }
    float dq[G::NT][4];
    zero_acc<G::NT>(dq);
    for (int kt = kt0; kt <= qt; ++kt) {
        const int k0 = kt * 64, cur = kt & 1;
        // (with fragments in registers, the Q/dO copy in the other buffer counts as tile kt0 - 1)
        next_kv_tile<HS>(Ks + (cur ^ 1) * G::TE, Vs + (cur ^ 1) * G::TE, kbase, NKV * HS, W, kt < qt ? k0 + 64 : -1, T);
        const bf16_t* Kc = Ks + cur * G::TE;
        float s[8][4], dp[8][4];
        zero_acc<8>(s);
        zero_acc<8>(dp);
        mma_abt<HS>(s, REGS ? qa : nullptr, Qt, warp * 16, Kc);
        mma_abt<HS>(dp, REGS ? oa : nullptr, dOt, warp * 16, Vs + cur * G::TE);
        const bool edge = kt == qt || k0 + 64 > T || q0 + 64 > T || (DOCS && k0 < ds_q[qrow - q0 + 8]);
        dq_dscores<DOCS>(s, dp, qrow, k0, t, T, edge, lr, dr, ds_q + (qrow - q0), sl2);
        mma_pz<HS>(dq, s, Kc);  // dQ += dS K
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = qrow + 8 * r;
        if (q >= T) continue;
        bf16_t* row = dqkv + ((long long)b * T + q) * W + h * HS + 2 * t;
#pragma unroll
        for (int j = 0; j < G::NT; ++j)
            *(unsigned*)(row + j * 8) = pack2(dq[j][2 * r] * scale, dq[j][2 * r + 1] * scale);
    }
}

// ptxas budgets: the one-m-tile forward (head size 64) is asked to fit three blocks per SM
// (left alone, it takes 176 registers: two blocks); the dK/dV kernel keeps every
// register it wants; the dQ kernel is asked
// to fit MINB blocks per SM (at HS 64, three: a few spilled registers buy more warps in
// flight, 0.552 -> 0.542 ms per call at GPT-2 1.5B shapes on an H200, where the same
// request makes the dK/dV kernel 5% slower).
#define ATTN_MMA_INSTANCES_(HS, FWD_MINB, DQ_MINB, SUF, DOCS, DOCS_PARAM, DOCS_ARG)                         \
    extern "C" __global__ void __launch_bounds__(128, FWD_MINB) attn_fwd_mma##HS##SUF(                        \
        bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH, int NKV, float scale DOCS_PARAM) {         \
        if constexpr (Mg<HS>::FWD_MT == 1)                                                                    \
            attn_fwd_mma16_impl<HS, DOCS>(out, lse, qkv, T, NH, NKV, scale, DOCS_ARG);                        \
        else                                                                                                  \
            attn_fwd_mma_impl<HS, DOCS>(out, lse, qkv, T, NH, NKV, scale, DOCS_ARG);                          \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128, 1)                                                      \
        attn_bwd_dkv_mma##HS##SUF(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse,      \
                                  const float* D, int T, int NH, int NKV, float scale, float* part,           \
                                  int S DOCS_PARAM) {                                                         \
        attn_bwd_dkv_mma_impl<HS, DOCS>(dqkv, dout, qkv, lse, D, T, NH, NKV, scale, part, S, DOCS_ARG);       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128, DQ_MINB)                                                \
        attn_bwd_dq_mma##HS##SUF(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse,       \
                                 const float* D, int T, int NH, int NKV, float scale DOCS_PARAM) {            \
        attn_bwd_dq_mma_impl<HS, DOCS>(dqkv, dout, qkv, lse, D, T, NH, NKV, scale, DOCS_ARG);                 \
    }
#define ATTN_MMA_INSTANCES(HS, FWD_MINB, DQ_MINB)                                \
    ATTN_MMA_INSTANCES_(HS, FWD_MINB, DQ_MINB, , false, , nullptr)               \
    ATTN_MMA_INSTANCES_(HS, FWD_MINB, DQ_MINB, _docs, true, DOCS_PARAM_, docs)

ATTN_MMA_INSTANCES(64, 3, 3)
ATTN_MMA_INSTANCES(80, 1, 2)
ATTN_MMA_INSTANCES(96, 1, 2)
ATTN_MMA_INSTANCES(128, 1, 2)

// ============================================================================
// Hopper (sm_90a: wgmma), head sizes 64 and 128: the forward, then the backward below.
// Forward: one warpgroup (the block's 4 warps) per 64 query rows; S = Q K^T and O += P V
// are warpgroup MMAs (wgmma.mma_async m64n64k16) with Q, K and V read from shared memory
// through matrix descriptors and P from registers. The wgmma accumulator layout is the
// mma.sync C layout per warp (16 rows each), so the online softmax is the mma.sync kernel's.
// K/V tiles streamed with cp.async, as there. H200, GPT-2 124M shapes (16 x 12 heads of 64,
// T 1024), mma.sync -> wgmma: forward 0.178 -> 0.099 ms (SDPA 0.119), backward 0.521 ->
// 0.287 ms (SDPA 0.366); 6.65B shapes (4 x 32 heads of 128): forward 0.230 -> 0.130 (SDPA
// 0.118), backward 0.660 -> 0.360 (SDPA 0.415) (BENCHMARKS.md run 10).
//
// Tiles of 64 rows x 64 bf16 (128 B per row) in 128-byte-swizzled shared memory: the 16-byte
// chunk c of row r sits at r * 128 + ((c ^ (r & 7)) << 4), tiles 1024-byte aligned (the
// swizzle is a function of the address bits, which the descriptors' swizzle mode matches).
// Built only where the compiler targets sm_90a (`__CUDA_ARCH_FEAT_SM90_ALL`); elsewhere the
// entry points trap and attention.rs never launches them. These kernels (alone) take an FP8
// amax sink: the largest |x| of what they write (the forward's output, the backward's dQ, dK,
// dV) max-ed into *amax where it is not null; for the other families attention.rs runs the
// amax as a pass of its own.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int NTH = 128>
__device__ __forceinline__ void load_tile_sw128_async(unsigned dst, const bf16_t* src, long long stride, int nvalid,
                                                      int tid = threadIdx.x) {
    // NTH threads, 8 per row (one 16-byte chunk each), NTH / 8 rows a pass: a thread's chunk
    // and its swizzle (which depends on row & 7) are the same on every pass, so each pass is
    // the first one's addresses plus constants (a loop from threadIdx.x would not unroll).
    static_assert(NTH % 64 == 0, "whole 8-row swizzle groups per pass");
    constexpr int RP = NTH / 8;  // rows per pass
    const int r0 = tid >> 3, ch = tid & 7;
    const unsigned d0 = dst + r0 * 128 + ((ch ^ (r0 & 7)) << 4);
    const bf16_t* g0 = src + (long long)r0 * stride + ch * 8;
#pragma unroll
    for (int i = 0; i < 64 / RP; ++i) {
        const bool ok = r0 + i * RP < nvalid;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d0 + i * RP * 128),
                     "l"(ok ? g0 + i * RP * stride : src), "r"(ok ? 16 : 0));
    }
}
// Matrix descriptor: start address, both byte offsets 1024 (the next 8-row group; the one
// of them a layout does not use is ignored), 128-byte swizzle.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(1024 >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

#define WG_D32(x)                                                                                                  \
    "+f"(x[0][0]), "+f"(x[0][1]), "+f"(x[0][2]), "+f"(x[0][3]), "+f"(x[1][0]), "+f"(x[1][1]), "+f"(x[1][2]),     \
        "+f"(x[1][3]), "+f"(x[2][0]), "+f"(x[2][1]), "+f"(x[2][2]), "+f"(x[2][3]), "+f"(x[3][0]), "+f"(x[3][1]), \
        "+f"(x[3][2]), "+f"(x[3][3]), "+f"(x[4][0]), "+f"(x[4][1]), "+f"(x[4][2]), "+f"(x[4][3]), "+f"(x[5][0]), \
        "+f"(x[5][1]), "+f"(x[5][2]), "+f"(x[5][3]), "+f"(x[6][0]), "+f"(x[6][1]), "+f"(x[6][2]), "+f"(x[6][3]), \
        "+f"(x[7][0]), "+f"(x[7][1]), "+f"(x[7][2]), "+f"(x[7][3])
#define WG_REGS32                                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64, fp32) (+)= A (64 x 16, smem, K-major) * B (16 x 64, smem, K-major).
__device__ __forceinline__ void wg_ss(float d[8][4], unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_D32(d)
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 64) += A (64 x 16, registers) * B (16 x 64, smem, N-major: rows of B contiguous).
__device__ __forceinline__ void wg_rs(float d[8][4], const unsigned a[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// d (64 x 64) = A B^T over HS = 64 NA columns: A and B are 64-row tiles of NA swizzle atoms
// (8 KiB each) at shared addresses a and b; 4 k-steps of 16 per atom. Issues only (the caller
// fences, commits and waits).
template <int NA>
__device__ __forceinline__ void wg_abt(float d[8][4], unsigned a, unsigned b) {
#pragma unroll
    for (int kk = 0; kk < 4 * NA; ++kk) {
        const int at = kk / 4, k = kk % 4;  // swizzle atom, k-step within it
        wg_ss(d, wg_desc(a + at * 8192) + 2 * k, wg_desc(b + at * 8192) + 2 * k, kk);
    }
}

// grid = (ceil(T/64), NH, B), 128 threads; dynamic smem = 5 tiles (Q; K, V x 2) of HS/64
// swizzle atoms of 8 KiB each (a row of 128 bf16 is two 64-column atoms, side by side in
// separate 8 KiB sub-tiles) + 1 KiB for the 1024-byte alignment. Every wgmma is n64: the
// score tile is 64 keys wide, and at head size 128 the output is two n64 halves, each with
// its V sub-tile as B (the layout the head-size-64 kernel verified).
template <int HS>
__device__ __forceinline__ void load_rows_sw128_async(unsigned dst, const bf16_t* src, long long stride, int nvalid) {
#pragma unroll
    for (int a = 0; a < HS / 64; ++a) load_tile_sw128_async(dst + a * 8192, src + a * 64, stride, nvalid);
}

// Compiler fences for wgmma operands: an empty asm that "rewrites" each register, placed
// after a wgmma wait, so that no use of an accumulator moves above the wait and no register
// a pending wgmma reads (P from registers) is reused before it (CUTLASS's
// warpgroup_fence_operand does the same).
template <int N>
__device__ __forceinline__ void fence_regs(float x[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(x[j][e])::"memory");
}
__device__ __forceinline__ void fence_afrags(unsigned a[4][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
}
__device__ __forceinline__ void fence_vals(float l[2], float alpha[2]) {
    asm volatile("" : "+f"(l[0]), "+f"(l[1]), "+f"(alpha[0]), "+f"(alpha[1])::"memory");
}
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// The forward, pipelined within the warpgroup (FlashAttention-3's intra-warpgroup overlap):
// for key tile kt it issues S = Q K_kt^T and O += P_(kt-1) V_(kt-1) back to back, waits for S
// only, and computes tile kt's probabilities while the tensor cores may still accumulate the
// previous tile's P V; the output's rescale waits for that. (ptxas, as of CUDA 13.0, places
// the second wait above the exponentials, so only the scaling and the row max overlap; on
// its own this measured no change, run 10.) V is triple-buffered (the P V of tile kt - 1
// still reads its V while tile kt + 1 loads), K double-buffered.
// grid = (ceil(T/64), NH, B), 128 threads; dynamic smem = Q, K x 2, V x 3 + 1 KiB for the
// 1024-byte alignment.
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_fwd_wg_impl(bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH, int NKV,
                                                 float scale, unsigned* amax, const unsigned* docs) {
    static_assert(HS == 64 || HS == 128, "the wgmma forward covers head sizes 64 and 128");
    constexpr int NA = HS / 64, TB = 8192 * NA;  // swizzle atoms per row, bytes per 64-row tile
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem(6 * TB + 1024);
    const unsigned sbase = (smem_addr(smem_mma) + 1023) & ~1023u;
    const unsigned Qs = sbase, Ks = sbase + TB, Vs = sbase + 3 * TB;  // K: two buffers, V: three
    const int nqt = gridDim.x, qt = nqt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const int q0 = qt * 64, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // Key tile j's K in buffer j % 2, its V in buffer j % 3; tile j + 1 is copied during tile j.
    auto load_kv = [&](int j) {
        const int k = j * 64;
        load_rows_sw128_async<HS>(Ks + (j & 1) * TB, kbase + (long long)k * W, W, min(64, T - k));
        load_rows_sw128_async<HS>(Vs + (j % 3) * TB, vbase + (long long)k * W, W, min(64, T - k));
    };
    float o[8 * NA][4];  // the output's n-tiles; half a (HS 128) is o[8a .. 8a + 7]
    unsigned pa[4][4];   // the previous tile's probabilities as A fragments (k-steps of 16 keys)
    auto accumulate_pv = [&](int j) {  // issue O += P_j V_j
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int a = 0; a < NA; ++a) wg_rs(o + 8 * a, pa[kk], wg_desc(Vs + (j % 3) * TB + a * 8192) + (2048 >> 4) * kk);
    };
    // The first key tile: 0, or with documents the first row's document's.
    int kt0 = 0;
    if constexpr (DOCS) kt0 = doc_first_tile<DOCS>(docs + (long long)b * T, q0, 64);
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    load_rows_sw128_async<HS>(Qs, base + (long long)q0 * W, W, min(64, T - q0));
    load_kv(kt0);
    cp_commit();
    if (qt > kt0) load_kv(kt0 + 1);
    cp_commit();
    zero_acc<8 * NA>(o);
    float m[2] = {-F_INF, -F_INF}, l[2] = {0.f, 0.f}, alpha[2];
    const int qrow = q0 + warp * 16 + g;  // this thread's rows: qrow, qrow + 8
    const int ds0 = doc_start<DOCS>(docs_b, qrow, T), ds1 = doc_start<DOCS>(docs_b, qrow + 8, T);
    float s[8][4];
    cp_wait<1>();  // Q and tile kt0
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes -> wgmma reads
    __syncthreads();
    wg_fence();
    wg_abt<NA>(s, Qs, Ks + (kt0 & 1) * TB);  // S = Q K_kt0^T
    wg_commit();
    wg_wait0();
    fence_regs<8>(s);
    softmax_probs<DOCS>(s, m, l, alpha,
                        TileMask{qrow, 64 * kt0, t, T, qt == kt0 || 64 * kt0 + 64 > T || (DOCS && 64 * kt0 < ds1), ds0, ds1},
                        sl2);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) pack_afrag(pa[kk], s, kk);
    for (int kt = kt0 + 1; kt <= qt; ++kt) {
        const int k0 = kt * 64;
        // Every warp is done with tile kt - 1's S (K buffer (kt + 1) % 2) and with tile
        // kt - 2's P V (V buffer (kt + 1) % 3): both were waited for last step.
        __syncthreads();
        if (kt < qt) load_kv(kt + 1);
        cp_commit();
        cp_wait<1>();  // tile kt
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        wg_fence();
        wg_abt<NA>(s, Qs, Ks + (kt & 1) * TB);  // S = Q K_kt^T
        wg_commit();
        accumulate_pv(kt - 1);
        wg_commit();
        wg_wait1();  // S of tile kt; tile kt - 1's P V may still run
        fence_regs<8>(s);
        const bool edge = kt == qt || k0 + 64 > T || (DOCS && k0 < ds1);
        softmax_probs<DOCS>(s, m, l, alpha, TileMask{qrow, k0, t, T, edge, ds0, ds1}, sl2);
        // The probabilities and sums exist before the wait below (ex2 is a plain asm, which
        // the compiler would otherwise sink past it, serializing the overlap).
        fence_regs<8>(s);
        fence_vals(l, alpha);
        wg_wait0();
        fence_regs<8 * NA>(o);
        fence_afrags(pa);
        rescale_acc<8 * NA>(o, alpha);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) pack_afrag(pa[kk], s, kk);
    }
    wg_fence();
    accumulate_pv(qt);
    wg_commit();
    wg_wait0();
    fence_regs<8 * NA>(o);
    fence_afrags(pa);
    unsigned am = 0;  // the output's amax (an FP8 amax sink: o's input), where amax is set
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = qrow + 8 * r;
        if (q >= T) continue;
        const float inv = 1.f / l[r];
        bf16_t* dst = out + ((long long)b * T + q) * C + h * HS + 2 * t;
#pragma unroll
        for (int a = 0; a < NA; ++a)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned v = pack2(o[8 * a + j][2 * r] * inv, o[8 * a + j][2 * r + 1] * inv);
                *(unsigned*)(dst + a * 64 + j * 8) = v;
                am = max_abs_bits2(v, am);
            }
        if (t == 0) lse[((long long)b * NH + h) * T + q] = m[r] + log2f(l[r]);
    }
    warp_amax_out(amax, am);
}

// Backward on Hopper, head sizes 64 and 128: the mma.sync kernels' two passes (attn_bwd_dkv_mma_impl,
// attn_bwd_dq_mma_impl) with every product a warpgroup MMA: the score-like products
// (K Q^T, V dO^T, Q K^T, dO V^T) read both operands from swizzled shared memory, the
// gradient products (P^T dO, dS^T Q, dS K) take P or dS from registers and the other
// operand N-major, as the forward's P V does. The element-wise work between them is the
// mma.sync kernels' (same accumulator layout per warp). At head size 128 every tile is two
// swizzle atoms and every gradient product two n64 halves, as in the forward. Shared memory:
// the block's own two tiles, the streamed two double-buffered (6 tiles of HS/64 x 8 KiB) +
// 1 KiB for alignment.

// Block per (key tile, key/value head) (grid: dkv_block): dK, dV of dqkv, or with S > 1
// fp32 partial sums. The group's query tiles stream as in the mma.sync kernel.
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_bwd_dkv_wg_impl(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                                     const float* lse, const float* D, int T, int NH, int NKV,
                                                     float scale, float* part, int S, unsigned* amax,
                                                     const unsigned* docs) {
    static_assert(HS == 64 || HS == 128, "the wgmma backward covers head sizes 64 and 128");
    constexpr int NA = HS / 64, TB = 8192 * NA;  // swizzle atoms per row, bytes per 64-row tile
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem(6 * TB + 1024);
    __shared__ __align__(16) float lse_s[2][64], d_s[2][64];
    __shared__ int ke[DOCS ? 64 : 1], nq_s[1];  // (DOCS: doc_key_ends)
    __shared__ unsigned starts[2];
    const unsigned sbase = (smem_addr(smem_mma) + 1023) & ~1023u;
    const unsigned Kt = sbase, Vt = sbase + TB, Qs = sbase + 2 * TB, dOs = sbase + 4 * TB;  // Q, dO: x 2
    const DkvBlock blk = dkv_block(NH, NKV, S);
    const int kt = blk.kt, hk = blk.hk, b = blk.b, nt = (T + 63) / 64, grp = NH / NKV;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const bf16_t* kbase = qkv + (long long)b * T * W + (NH + hk) * HS;
    const int k0 = kt * 64, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // The run of (query head, query tile) pairs and the next pair's head pointers, as in
    // attn_bwd_dkv_mma_impl (with documents: nq_s query tiles, ke the keys' documents' ends).
    if (DOCS) {
        doc_key_ends(docs + (long long)b * T, kt, nt, T, ke, nq_s, starts);
        __syncthreads();
    }
    const int nq = DOCS ? nq_s[0] : nt - kt;
    const int n = grp * nq, i0 = blk.s * n / S, i1 = (blk.s + 1) * n / S;
    int qt = kt + i0 % nq;
    const long long h0 = (long long)hk * grp + i0 / nq;
    const bf16_t* qh = qkv + (long long)b * T * W + h0 * HS;
    const bf16_t* doh = dout + (long long)b * T * C + h0 * HS;
    const float* lh = lse + ((long long)b * NH + h0) * T;
    const float* dh = D + ((long long)b * NH + h0) * T;
    const int qf = qt * 64;
    load_rows_sw128_async<HS>(Kt, kbase + (long long)k0 * W, W, min(64, T - k0));
    load_rows_sw128_async<HS>(Vt, kbase + NKV * HS + (long long)k0 * W, W, min(64, T - k0));
    load_rows_sw128_async<HS>(Qs, qh + (long long)qf * W, W, min(64, T - qf));
    load_rows_sw128_async<HS>(dOs, doh + (long long)qf * C, C, min(64, T - qf));
    load_row64_async(lse_s[0], lh, qf, T, 0);
    load_row64_async(d_s[0], dh, qf, T, 64);
    cp_commit();
    float dk[NA][8][4], dv[NA][8][4];
#pragma unroll
    for (int a = 0; a < NA; ++a) {
        zero_acc<8>(dk[a]);
        zero_acc<8>(dv[a]);
    }
    const int krow = k0 + warp * 16 + g;  // this thread's keys: krow, krow + 8
    for (int i = i0; i < i1; ++i) {
        const int q0 = qt * 64, cur = (i - i0) & 1;
        int qn = qt + 1;  // the next pair: this head's next query tile, or the next head's first
        if (qn == (DOCS ? kt + nq_s[0] : nt)) {
            qn = kt;
            qh += HS;
            doh += HS;
            lh += T;
            dh += T;
        }
        __syncthreads();  // buffer cur ^ 1 (the previous query tile) is no longer read
        if (i + 1 < i1) {
            const int q1 = qn * 64;
            load_rows_sw128_async<HS>(Qs + (cur ^ 1) * TB, qh + (long long)q1 * W, W, min(64, T - q1));
            load_rows_sw128_async<HS>(dOs + (cur ^ 1) * TB, doh + (long long)q1 * C, C, min(64, T - q1));
            load_row64_async(lse_s[cur ^ 1], lh, q1, T, 0);
            load_row64_async(d_s[cur ^ 1], dh, q1, T, 64);
        }
        cp_commit();
        cp_wait<1>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes -> wgmma reads
        __syncthreads();  // query tile qt is in buffer cur
        const unsigned Qc = Qs + cur * TB, dOc = dOs + cur * TB;
        float st[8][4], dpt[8][4];  // S^T and dP^T: rows = keys, columns = queries
        wg_fence();
        wg_abt<NA>(st, Kt, Qc);
        wg_abt<NA>(dpt, Vt, dOc);
        wg_commit();
        wg_wait0();
        // (DOCS) a query of the tile at or after the end of this thread's first key's document
        const bool edge = qt == kt || q0 + 64 > T || k0 + 64 > T || (DOCS && q0 + 63 >= ke[krow - k0]);
        const float* ls = lse_s[cur];
        const float* ds = d_s[cur];
        dkv_dscores<DOCS>(st, dpt, krow, q0, t, T, edge, ls, ds, ke, k0, sl2);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned pa[4], sa[4];
            pack_afrag(pa, st, kk);
            pack_afrag(sa, dpt, kk);
#pragma unroll
            for (int a = 0; a < NA; ++a) {
                wg_rs(dv[a], pa, wg_desc(dOc + a * 8192) + (2048 >> 4) * kk);  // dV += P^T dO
                wg_rs(dk[a], sa, wg_desc(Qc + a * 8192) + (2048 >> 4) * kk);   // dK += dS^T Q
            }
        }
        wg_commit();
        wg_wait0();
        qt = qn;
    }
    unsigned am = 0;  // dK's and dV's amax (with S == 1; an FP8 amax sink: qkv's dY)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int k = krow + 8 * r;
        if (k >= T) continue;
        if (S == 1) {
            bf16_t* row = dqkv + ((long long)b * T + k) * W + (NH + hk) * HS + 2 * t;
#pragma unroll
            for (int a = 0; a < NA; ++a)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const unsigned kv = pack2(dk[a][j][2 * r] * scale, dk[a][j][2 * r + 1] * scale);
                    const unsigned vv = pack2(dv[a][j][2 * r], dv[a][j][2 * r + 1]);
                    *(unsigned*)(row + a * 64 + j * 8) = kv;
                    *(unsigned*)(row + NKV * HS + a * 64 + j * 8) = vv;
                    am = max_abs_bits2(kv, max_abs_bits2(vv, am));
                }
        } else {
            float* row = dkv_part_row<HS>(part, T, k) + 2 * t;
#pragma unroll
            for (int a = 0; a < NA; ++a)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    *(float2*)(row + a * 64 + j * 8) = make_float2(dk[a][j][2 * r], dk[a][j][2 * r + 1]);
                    *(float2*)(row + HS + a * 64 + j * 8) = make_float2(dv[a][j][2 * r], dv[a][j][2 * r + 1]);
                }
        }
    }
    warp_amax_out(amax, am);
}

// D of one row, what attn_bwd_d8 computes to the bit, by the four threads of a quad (lanes
// 4g .. 4g + 3, t = lane & 3; dorow, orow the row's dO and O, 16-byte aligned): thread t takes
// chunks t, t + 4, ... of 8 values (dot8) and adds them as attn_bwd_d8's shuffles of stride 4
// and more would (chunk m + k into chunk m, k = HS / 64 .. 1 in steps of four chunks), then
// the quad's strides 2 and 1 by shuffles. Every lane of the warp calls it (valid false: 0).
template <int HS>
__device__ __forceinline__ float d_row_quad(const bf16_t* dorow, const bf16_t* orow, int t, bool valid) {
    constexpr int NC = HS / 32;  // chunks a thread
    float c[NC];
#pragma unroll
    for (int m = 0; m < NC; ++m) {
        const int off = 8 * (t + 4 * m);
        c[m] = valid ? dot8(*(const uint4*)(dorow + off), *(const uint4*)(orow + off)) : 0.f;
    }
#pragma unroll
    for (int k = NC / 2; k >= 1; k >>= 1)
#pragma unroll
        for (int m = 0; m < k; ++m) c[m] += c[m + k];
    float acc = c[0];
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    return acc;
}

// Block per (query tile, query head): dQ of dqkv (its amax into amax where set). With `out`
// (O, 16-byte aligned) the block also computes its rows' D = rowsum(dO ⊙ O) and writes them
// for the dK/dV pass, which then runs after it (attention.rs): no D kernel, whose reads of
// dO and O (the whole of both) took ~5% of the backward; without, it reads D.
template <int HS, bool DOCS>
__device__ __forceinline__ void attn_bwd_dq_wg_impl(bf16_t* dqkv, const bf16_t* dout, const bf16_t* out,
                                                    const bf16_t* qkv, const float* lse, float* D, int T,
                                                    int NH, int NKV, float scale, unsigned* amax,
                                                    const unsigned* docs) {
    static_assert(HS == 64 || HS == 128, "the wgmma backward covers head sizes 64 and 128");
    constexpr int NA = HS / 64, TB = 8192 * NA;
    extern __shared__ __align__(16) bf16_t smem_mma[];
    require_smem(6 * TB + 1024);
    const unsigned sbase = (smem_addr(smem_mma) + 1023) & ~1023u;
    const unsigned Qt = sbase, dOt = sbase + TB, Ks = sbase + 2 * TB, Vs = sbase + 4 * TB;  // K, V: x 2
    const int nt = gridDim.x, qt = nt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const long long bh = (long long)b * NH + h;
    const bf16_t* base = qkv + (long long)b * T * W + h * HS;
    const bf16_t* kbase = kv_head<HS>(qkv, b, T, NH, NKV, h);
    const bf16_t* vbase = kbase + NKV * HS;
    const bf16_t* dobase = dout + (long long)b * T * C + h * HS;
    const int q0 = qt * 64, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E_F;
    // The first key tile kt0 (0, or with documents the first row's document's) in buffer
    // kt0 % 2 (key tile kt in kt % 2). (DOCS) The rows' document starts in shared memory.
    __shared__ int ds_q[DOCS ? 64 : 1];
    const unsigned* docs_b = DOCS ? docs + (long long)b * T : nullptr;
    if (DOCS && threadIdx.x < 64) ds_q[threadIdx.x] = doc_start<DOCS>(docs_b, q0 + threadIdx.x, T);
    const int kt0 = doc_first_tile<DOCS>(docs_b, q0, 64), kf = kt0 * 64, c0 = kt0 & 1;
    load_rows_sw128_async<HS>(Qt, base + (long long)q0 * W, W, min(64, T - q0));
    load_rows_sw128_async<HS>(dOt, dobase + (long long)q0 * C, C, min(64, T - q0));
    load_rows_sw128_async<HS>(Ks + c0 * TB, kbase + (long long)kf * W, W, min(64, T - kf));
    load_rows_sw128_async<HS>(Vs + c0 * TB, vbase + (long long)kf * W, W, min(64, T - kf));
    cp_commit();
    const int qrow = q0 + warp * 16 + g;  // this thread's rows: qrow, qrow + 8
    float lr[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = qrow + 8 * r;
        lr[r] = q < T ? lse[bh * T + q] : 0.f;
        if (out) {  // (uniform: every lane of the warp takes this branch or none)
            const long long at = (long long)b * T * C + (long long)q * C + h * HS;
            dr[r] = d_row_quad<HS>(dout + at, out + at, t, q < T);
            if (q < T && t == 0) D[bh * T + q] = dr[r];
        } else {
            dr[r] = q < T ? D[bh * T + q] : 0.f;
        }
    }
    float dq[NA][8][4];
#pragma unroll
    for (int a = 0; a < NA; ++a) zero_acc<8>(dq[a]);
    for (int kt = kt0; kt <= qt; ++kt) {
        const int k0 = kt * 64, cur = kt & 1;
        __syncthreads();  // buffer cur ^ 1 (key tile kt - 1) is no longer read
        if (kt < qt) {
            const int k1 = k0 + 64;
            load_rows_sw128_async<HS>(Ks + (cur ^ 1) * TB, kbase + (long long)k1 * W, W, min(64, T - k1));
            load_rows_sw128_async<HS>(Vs + (cur ^ 1) * TB, vbase + (long long)k1 * W, W, min(64, T - k1));
        }
        cp_commit();
        cp_wait<1>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes -> wgmma reads
        __syncthreads();
        const unsigned Kc = Ks + cur * TB, Vc = Vs + cur * TB;
        float s[8][4], dp[8][4];
        wg_fence();
        wg_abt<NA>(s, Qt, Kc);
        wg_abt<NA>(dp, dOt, Vc);
        wg_commit();
        wg_wait0();
        const bool edge = kt == qt || k0 + 64 > T || q0 + 64 > T || (DOCS && k0 < ds_q[qrow - q0 + 8]);
        dq_dscores<DOCS>(s, dp, qrow, k0, t, T, edge, lr, dr, ds_q + (qrow - q0), sl2);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned sa[4];
            pack_afrag(sa, s, kk);
#pragma unroll
            for (int a = 0; a < NA; ++a) wg_rs(dq[a], sa, wg_desc(Kc + a * 8192) + (2048 >> 4) * kk);  // dQ += dS K
        }
        wg_commit();
        wg_wait0();
    }
    unsigned am = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int q = qrow + 8 * r;
        if (q >= T) continue;
        bf16_t* row = dqkv + ((long long)b * T + q) * W + h * HS + 2 * t;
#pragma unroll
        for (int a = 0; a < NA; ++a)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned v = pack2(dq[a][j][2 * r] * scale, dq[a][j][2 * r + 1] * scale);
                *(unsigned*)(row + a * 64 + j * 8) = v;
                am = max_abs_bits2(v, am);
            }
    }
    warp_amax_out(amax, am);
}

#define ATTN_WG_INSTANCES_(HS, SUF, DOCS, DOCS_PARAM, DOCS_ARG)                                             \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_wg##HS##SUF(                                   \
        bf16_t* out, float* lse, const bf16_t* qkv, int T, int NH, int NKV, float scale,                      \
        unsigned* amax DOCS_PARAM) {                                                                          \
        attn_fwd_wg_impl<HS, DOCS>(out, lse, qkv, T, NH, NKV, scale, amax, DOCS_ARG);                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                         \
        attn_bwd_dkv_wg##HS##SUF(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse,       \
                                 const float* D, int T, int NH, int NKV, float scale, float* part, int S,     \
                                 unsigned* amax DOCS_PARAM) {                                                 \
        attn_bwd_dkv_wg_impl<HS, DOCS>(dqkv, dout, qkv, lse, D, T, NH, NKV, scale, part, S, amax, DOCS_ARG);  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                         \
        attn_bwd_dq_wg##HS##SUF(bf16_t* dqkv, const bf16_t* dout, const bf16_t* out, const bf16_t* qkv,       \
                                const float* lse, float* D, int T, int NH, int NKV, float scale,              \
                                unsigned* amax DOCS_PARAM) {                                                  \
        attn_bwd_dq_wg_impl<HS, DOCS>(dqkv, dout, out, qkv, lse, D, T, NH, NKV, scale, amax, DOCS_ARG);       \
    }
#else
// (not sm_90a: entry points with the same parameters that trap; attention.rs never launches them)
#define ATTN_WG_INSTANCES_(HS, SUF, DOCS, DOCS_PARAM, DOCS_ARG)                                             \
    extern "C" __global__ void attn_fwd_wg##HS##SUF(bf16_t*, float*, const bf16_t*, int, int, int, float,    \
                                                    unsigned* DOCS_PARAM) {                                   \
        __trap();                                                                                             \
    }                                                                                                         \
    extern "C" __global__ void attn_bwd_dkv_wg##HS##SUF(bf16_t*, const bf16_t*, const bf16_t*, const float*, \
                                                        const float*, int, int, int, float, float*, int,      \
                                                        unsigned* DOCS_PARAM) {                               \
        __trap();                                                                                             \
    }                                                                                                         \
    extern "C" __global__ void attn_bwd_dq_wg##HS##SUF(bf16_t*, const bf16_t*, const bf16_t*, const bf16_t*, \
                                                       const float*, float*, int, int, int, float,            \
                                                       unsigned* DOCS_PARAM) {                                \
        __trap();                                                                                             \
    }
#endif
#define ATTN_WG_INSTANCES(HS)                                  \
    ATTN_WG_INSTANCES_(HS, , false, , nullptr)                 \
    ATTN_WG_INSTANCES_(HS, _docs, true, DOCS_PARAM_, docs)
ATTN_WG_INSTANCES(64)
ATTN_WG_INSTANCES(128)
