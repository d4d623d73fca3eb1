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

// The kernels are split by generation, each file its own NVRTC module (attention.rs):
// attention_simt.cu (fp32 SIMT), attention_mma.cu (tensor cores, mma.sync) and
// attention_wgmma.cu (Hopper's warpgroup MMAs); attention.cuh has what all of them share
// and attention_mma.cuh what the two tensor-core generations share. This file: the kernels
// every generation launches (D = rowsum(dO * O), and the sum of a split dK/dV pass).

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
