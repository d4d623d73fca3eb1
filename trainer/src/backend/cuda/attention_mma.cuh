// What the two tensor-core generations share (attention_mma.cu, attention_wgmma.cu):
//
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

// The dK/dV block's prologue, the same in the mma.sync and wgmma kernels: which (key tile,
// key/value head, batch, split) the block is (dkv_block), the row stride of qkv, its first
// key, the softmax scale in log2 units, and the block's run of
// (query head, query tile) pairs, i in [i0, i1), i = j nq + qt - kt for query head
// hk grp + j: nq query tiles from kt, to T, or with documents to the end of the document of
// the tile's last key (nq_s; ke: the keys' documents' ends, both filled here, then synced).
struct DkvRun {
    int kt, hk, b, nt, grp, C;
    long long W;
    int k0;
    float sl2;
    int nq, i0, i1;
};
template <int HS, bool DOCS>
__device__ __forceinline__ DkvRun dkv_run(int T, int NH, int NKV, float scale, int S, const unsigned* docs,
                                          int* ke, int* nq_s, unsigned* starts) {
    const DkvBlock blk = dkv_block(NH, NKV, S);
    const int kt = blk.kt, hk = blk.hk, b = blk.b, nt = (T + 63) / 64, grp = NH / NKV;
    const int C = NH * HS;
    const long long W = qkv_stride<HS>(NH, NKV);
    const int k0 = kt * 64;
    const float sl2 = scale * LOG2E_F;
    if (DOCS) {
        doc_key_ends(docs + (long long)b * T, kt, nt, T, ke, nq_s, starts);
        __syncthreads();
    }
    const int nq = DOCS ? nq_s[0] : nt - kt;
    const int n = grp * nq, i0 = blk.s * n / S, i1 = (blk.s + 1) * n / S;
    return DkvRun{kt, hk, b, nt, grp, C, W, k0, sl2, nq, i0, i1};
}
