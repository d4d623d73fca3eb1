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
    // The block, its keys, and its run of (query head, query tile) pairs (dkv_run), as in
    // attn_bwd_dkv_mma_impl; then the next pair's head pointers.
    const DkvRun run = dkv_run<HS, DOCS>(T, NH, NKV, scale, S, docs, ke, nq_s, starts);
    const int kt = run.kt, hk = run.hk, b = run.b, nt = run.nt, grp = run.grp, C = run.C;
    const long long W = run.W;
    const bf16_t* kbase = qkv + (long long)b * T * W + (NH + hk) * HS;
    const int k0 = run.k0, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float sl2 = run.sl2;
    const int nq = run.nq, i0 = run.i0, i1 = run.i1;
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
