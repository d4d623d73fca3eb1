// Attention in fp32 SIMT kernels (attention.cu has the design; attention.cuh the shared
// helpers): head sizes 32, 64 and 128, the fallback for 32 and the cross-check of the
// tensor-core kernels.
//
// All arithmetic is fp32 (SIMT); q, k, v, dO are read as bf16 and widened in shared
// memory. Block = 256 threads as 16 x 16 (ty, tx): for a 64 x 64 score tile a thread
// owns rows ty + 16i and columns tx + 16j (i, j < 4); for a 64 x HS output tile it owns
// rows ty + 16i and the DPT = HS/16 contiguous columns tx*DPT... The strided rows and
// the padded row lengths (HS + 4 floats, an odd number of 16-byte words; 80 floats for
// score tiles) keep the shared-memory reads free of bank conflicts.

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
#define ATTN_INSTANCES(HS)                                  \
    ATTN_INSTANCES_(HS, , false, , nullptr)                 \
    ATTN_INSTANCES_(HS, _docs, true, DOCS_PARAM_, docs)

// (The SIMT kernels need HS / 16 to be a multiple of 2 for their vector accesses: no 80, 96.)
ATTN_INSTANCES(32)
ATTN_INSTANCES(64)
ATTN_INSTANCES(128)
