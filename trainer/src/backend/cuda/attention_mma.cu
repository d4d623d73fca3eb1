// The tensor-core attention kernels on mma.sync (design and helpers: attention_mma.cuh).

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
    // The block, its keys, and its run of (query head, query tile) pairs (dkv_run): (h, qt)
    // is the pair to load next.
    const DkvRun run = dkv_run<HS, DOCS>(T, NH, NKV, scale, S, docs, ke, nq_s, starts);
    const int kt = run.kt, hk = run.hk, b = run.b, nt = run.nt, grp = run.grp, C = run.C;
    const long long W = run.W;
    const bf16_t* kbase = qkv + (long long)b * T * W + (NH + hk) * HS;
    const int k0 = run.k0, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = run.sl2;
    const int nq = run.nq, i0 = run.i0, i1 = run.i1;
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
