// LayerNorm and RMSNorm (twin of cpu/layernorm.rs). Statistics in fp32; LayerNorm takes two
// passes over the row (mean, then the centred variance) as the CPU reference does, RMSNorm
// one (the mean square).
//
// Backward is deterministic: each block owns a fixed chunk of rows and writes its
// partial dw/db sums to a scratch array, which reduce_partials (reduce.cu) then adds up
// in chunk order. No atomics. RMSNorm's backward is the same kernels (template flag RMS:
// no mean, no db, no mean(dnorm) term), so it inherits their speed and their ordering;
// with RMS = false the code is LayerNorm's as before (the same arithmetic, the same bits).

// LN_EPS (cpu::LN_EPS), LN_BWD_SLOTS, LN_BWD_MAX_ROWS and RMS_FWD_THREADS come from the
// launch code as -D options.

// A LayerNorm row's statistics, written by its warp's first lane. Without an output and an
// amax sink (an FP8 cast that applies the norm and predicts its scale) they are all a forward
// writes: the output's computation is skipped.
__device__ __forceinline__ void ln_stats_out(float* mean, float* rstd, int row, float m, float r, int lane) {
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// A row of C <= 256·NV values (C % 8 == 0, 16-byte aligned) held in a warp's registers: lane
// `lane` loads its 16-byte words c = 8·lane + 256·j for every j < NV at once (all the row's
// loads in flight, one read of it), then sums, centres and normalizes from the registers in
// the order the loop below takes them (the same bits).
template <int NV>
__device__ __forceinline__ void layernorm_fwd_regs(bf16_t* o, float* mean, float* rstd, const bf16_t* x,
                                                   const bf16_t* w, const bf16_t* b, int row, int C, unsigned* amax,
                                                   int lane) {
    uint4 xv[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = lane * 8 + 256 * j;
        if (c < C) xv[j] = *(const uint4*)(x + c);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        if (lane * 8 + 256 * j < C) {
            float f[8];
            unpack8(xv[j], f);
#pragma unroll
            for (int k = 0; k < 8; ++k) s += f[k];
        }
    }
    const float m = warp_sum(s) / C;
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        if (lane * 8 + 256 * j < C) {
            float f[8];
            unpack8(xv[j], f);
#pragma unroll
            for (int k = 0; k < 8; ++k) v += (f[k] - m) * (f[k] - m);
        }
    }
    const float r = 1.f / sqrtf(warp_sum(v) / C + LN_EPS);
    if (!o && !amax) return ln_stats_out(mean, rstd, row, m, r, lane);
    unsigned am = 0;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = lane * 8 + 256 * j;
        if (c < C) {
            float f[8], ww[8], bb[8];
            unpack8(xv[j], f);
            unpack8(*(const uint4*)(w + c), ww);
            unpack8(*(const uint4*)(b + c), bb);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = (f[k] - m) * r * ww[k] + bb[k];
            const uint4 y = pack8(f);
            if (o) *(uint4*)(o + c) = y;
            am = max_abs8(y, am);
        }
    }
    warp_amax_out(amax, am);
    ln_stats_out(mean, rstd, row, m, r, lane);
}

// One warp per row; blockDim.x = 256 (8 rows per block). The amax of out into *amax where it
// is not null (an FP8 amax sink: the next GEMM's input). A null out writes only the
// statistics, and the amax where that is set (layernorm_stats: an FP8 cast applies the norm
// itself). Aligned rows (C % 8 == 0, 16-byte aligned rows, output, weight and bias) of up to 4096
// values take layernorm_fwd_r{4,8,16} (layernorm.rs picks), which hold the row in registers
// (layernorm_fwd_regs); longer or unaligned ones this kernel, which reads the row three times
// (from L1 after the first). Each at most the registers that let its blocks fill an SM: the
// compiler gave one kernel holding every width 96 registers (2 blocks an SM), and GPT-2
// 1.5B's 8192 × 1600 took 23.0 µs without the output and 28.1 with it, where the 64-register
// r8 takes 18.5–20.0 and 23.6–24.4 (dev/layernorm-variants.sh, BENCHMARKS.md run 27): the
// same code, the same bits.
#define LN_FWD_REGS(NV, MIN_BLOCKS)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS)                                            \
        layernorm_fwd_r##NV(bf16_t* out, float* mean, float* rstd, const bf16_t* inp, const bf16_t* w,       \
                            const bf16_t* b, int N, int C, unsigned* amax) {                                 \
        const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                                 \
        if (row >= N) return;                                                                                \
        layernorm_fwd_regs<NV>(out ? out + (long long)row * C : nullptr, mean, rstd, inp + (long long)row * C, \
                               w, b, row, C, amax, threadIdx.x & 31);                                        \
    }
LN_FWD_REGS(4, 4)
LN_FWD_REGS(8, 4)
LN_FWD_REGS(16, 2)

extern "C" __global__ void layernorm_fwd(bf16_t* out, float* mean, float* rstd, const bf16_t* inp,
                                         const bf16_t* w, const bf16_t* b, int N, int C, unsigned* amax) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const bf16_t* x = inp + (long long)row * C;
    bf16_t* o = out ? out + (long long)row * C : nullptr;
    const bool vec = (C % 8 == 0) && aligned16(x) && aligned16(o) && aligned16(w) && aligned16(b);
    float s = 0.f;
    if (vec) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8];
            unpack8(*(const uint4*)(x + c), f);
#pragma unroll
            for (int k = 0; k < 8; ++k) s += f[k];
        }
    } else {
        for (int c = lane; c < C; c += 32) s += bf2f(x[c]);
    }
    const float m = warp_sum(s) / C;
    float v = 0.f;
    if (vec) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8];
            unpack8(*(const uint4*)(x + c), f);
#pragma unroll
            for (int k = 0; k < 8; ++k) v += (f[k] - m) * (f[k] - m);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            const float d = bf2f(x[c]) - m;
            v += d * d;
        }
    }
    const float r = 1.f / sqrtf(warp_sum(v) / C + LN_EPS);
    if (!out && !amax) return ln_stats_out(mean, rstd, row, m, r, lane);
    unsigned am = 0;
    if (vec) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8], ww[8], bb[8];
            unpack8(*(const uint4*)(x + c), f);
            unpack8(*(const uint4*)(w + c), ww);
            unpack8(*(const uint4*)(b + c), bb);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = (f[k] - m) * r * ww[k] + bb[k];
            const uint4 y = pack8(f);
            if (out) *(uint4*)(o + c) = y;
            am = max_abs8(y, am);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            const bf16_t y = f2bf((bf2f(x[c]) - m) * r * bf2f(w[c]) + bf2f(b[c]));
            if (out) o[c] = y;
            am = max(am, abs_bits(y));
        }
    }
    warp_amax_out(amax, am);
    ln_stats_out(mean, rstd, row, m, r, lane);
}

// Block k handles rows [k*rows_per_block, ...). dinp += (overwritten with the sum),
// partial[k] = [dw (C) | db (C)] for the block's rows (RMS: [dw (C)], and mean unused).
// The amax of the dinp written into *amax where it is not null (an FP8 amax sink: dinp is
// the residual gradient, the next FP8 GEMM's output gradient), here and in the fast kernels.
// Dynamic shared memory: 2*C floats (RMS: C).
template <bool RMS>
__device__ __forceinline__ void ln_bwd_general(bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp,
                                               const bf16_t* w, const float* mean, const float* rstd, int N, int C,
                                               int rows_per_block, unsigned* amax) {
    unsigned am = 0;
    extern __shared__ float sacc[];  // [dw (C) | db (C)], slot c owned by thread c % blockDim
    __shared__ float red[32];
    float* dw_acc = sacc;
    float* db_acc = sacc + C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        dw_acc[c] = 0.f;
        if constexpr (!RMS) db_acc[c] = 0.f;
    }
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(N, r0 + rows_per_block);
    for (int row = r0; row < r1; ++row) {
        const bf16_t* x = inp + (long long)row * C;
        const bf16_t* dy = dout + (long long)row * C;
        bf16_t* dx = dinp + (long long)row * C;
        const float m = RMS ? 0.f : mean[row], s = rstd[row];
        float a = 0.f, bsum = 0.f;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            if constexpr (RMS) {
                bsum += bf2f(w[c]) * bf2f(dy[c]) * (bf2f(x[c]) * s);
            } else {
                const float norm = (bf2f(x[c]) - m) * s;
                const float dn = bf2f(w[c]) * bf2f(dy[c]);
                a += dn;
                bsum += dn * norm;
            }
        }
        if constexpr (!RMS) a = block_sum(a, red) / C;
        bsum = block_sum(bsum, red) / C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float g = bf2f(dy[c]);
            if constexpr (RMS) {
                const float norm = bf2f(x[c]) * s;
                const float dn = bf2f(w[c]) * g;
                dw_acc[c] += norm * g;
                dx[c] = f2bf(bf2f(dx[c]) + (dn - norm * bsum) * s);
                am = max(am, abs_bits(dx[c]));
            } else {
                const float norm = (bf2f(x[c]) - m) * s;
                const float dn = bf2f(w[c]) * g;
                db_acc[c] += g;
                dw_acc[c] += norm * g;
                dx[c] = f2bf(bf2f(dx[c]) + (dn - a - norm * bsum) * s);
                am = max(am, abs_bits(dx[c]));
            }
        }
    }
    // Every thread of the block gets here (the row loop is the block's): whole warps.
    warp_amax_out(amax, am);
    float* p = partial + (long long)blockIdx.x * (RMS ? 1 : 2) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        p[c] = dw_acc[c];
        if constexpr (!RMS) p[C + c] = db_acc[c];
    }
}

extern "C" __global__ void layernorm_bwd(bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp,
                                         const bf16_t* w, const float* mean, const float* rstd, int N, int C,
                                         int rows_per_block, unsigned* amax) {
    ln_bwd_general<false>(dinp, partial, dout, inp, w, mean, rstd, N, C, rows_per_block, amax);
}

// The same for RMSNorm (mean is not read: the launch code passes null).
extern "C" __global__ void rmsnorm_bwd(bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp,
                                       const bf16_t* w, const float* mean, const float* rstd, int N, int C,
                                       int rows_per_block, unsigned* amax) {
    ln_bwd_general<true>(dinp, partial, dout, inp, w, mean, rstd, N, C, rows_per_block, amax);
}

// The 16-byte-chunk steps of the fast backward, on chunks already loaded (8 bf16 values
// of x, dy and w at one column, and of the row's dx). Chunk of a row with mean m and
// rstd s: its contribution to the row's two sums, a += w*dy and bsum += w*dy*norm (RMS:
// bsum only, norm = x*s);
template <bool RMS>
__device__ __forceinline__ void ln_bwd_chunk_sums(uint4 xv, uint4 gv, uint4 wv, float m, float s, float& a,
                                                  float& bsum) {
    float xf[8], gf[8], wf[8];
    unpack8(xv, xf);
    unpack8(gv, gf);
    unpack8(wv, wf);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float dn = wf[k] * gf[k];
        if constexpr (RMS) {
            bsum += dn * (xf[k] * s);
        } else {
            a += dn;
            bsum += dn * ((xf[k] - m) * s);
        }
    }
}

// with the row's a and bsum (already divided by C): dx plus its gradient (returned), and
// the chunk's dw/db accumulated into dwacc/dbacc (8 values each; RMS: no db, no a);
template <bool RMS>
__device__ __forceinline__ uint4 ln_bwd_chunk_apply(uint4 dxv, uint4 xv, uint4 gv, uint4 wv, float m, float s,
                                                    float a, float bsum, float* dwacc, float* dbacc) {
    float xf[8], gf[8], wf[8], df[8];
    unpack8(xv, xf);
    unpack8(gv, gf);
    unpack8(wv, wf);
    unpack8(dxv, df);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if constexpr (RMS) {
            const float norm = xf[k] * s;
            const float dn = wf[k] * gf[k];
            dwacc[k] += norm * gf[k];
            df[k] += (dn - norm * bsum) * s;
        } else {
            const float norm = (xf[k] - m) * s;
            const float dn = wf[k] * gf[k];
            dbacc[k] += gf[k];
            dwacc[k] += norm * gf[k];
            df[k] += (dn - a - norm * bsum) * s;
        }
    }
    return pack8(df);
}

// and a chunk's accumulated dw/db written to p = [dw (C) | db (C)] at column c (a partial
// row; RMS: p = [dw (C)]).
template <bool RMS>
__device__ __forceinline__ void ln_bwd_chunk_store(float* p, int C, int c, const float* dwacc, const float* dbacc) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        p[c + k] = dwacc[k];
        if constexpr (!RMS) p[C + c + k] = dbacc[k];
    }
}

__device__ __forceinline__ uint4 ld16(const bf16_t* p) { return *(const uint4*)p; }

// Fast backward for C % 8 == 0, C <= 8192, 16-byte aligned rows: a block of W warps per
// run of rows, each thread owning the J 16-byte chunks c = 8 * tid + j * 256 * W of every
// row (J and W template parameters). Rows go two at a time: each row's two sums go
// warp_sum, then across the block's warps through shared memory in warp order
// (deterministic), both rows' sums behind one barrier — the per-row chain of reductions
// and barrier, not memory, is what bounded this kernel (ncu at 1.5B's rows: 0.97 waves,
// 21% of warps resident, 53% of DRAM bandwidth). The rows stream through a ring of four
// slots in shared memory filled by cp.async: the next pair's x, dy and dx copies are in
// flight during this pair's arithmetic, without holding registers. Each thread copies and
// reads back only its own chunks, so its own cp.async wait is all the ordering a slot
// needs. w stays in registers for the whole run; dw/db accumulate in registers, rows in
// order, and leave as partial row `blockIdx.x`; reduce_partials then adds the partial rows
// in order: deterministic, no atomics, the same bits on every GPU (and as one row at a
// time: the same sums in the same order).
// RMS (RMSNorm): the same stream with one sum per row (bsum = Σ w·dy·x·rstd), no mean
// (not read), no db; partial rows of C floats.
// Dynamic shared memory: LN_BWD_SLOTS * 3 * J * blockDim 16-byte chunks (layernorm.rs).
template <int J>
__device__ __forceinline__ void ln_bwd_issue_row(uint4* slot, const bf16_t* inp, const bf16_t* dout,
                                                 const bf16_t* dinp, int row, int C, int c0, int stride) {
    const long long o = (long long)row * C;
    const bf16_t* src[3] = {inp + o, dout + o, dinp + o};
#pragma unroll
    for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = c0 + j * stride;
            if (c < C)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                                 smem_addr(slot + (a * J + j) * blockDim.x + threadIdx.x)),
                             "l"(src[a] + c));
        }
}

// This thread's chunk j of field a (0 x, 1 dy, 2 dx) in a ring slot.
template <int J>
__device__ __forceinline__ uint4 ln_slot(const uint4* slot, int a, int j) {
    return slot[(a * J + j) * blockDim.x + threadIdx.x];
}

template <int J, int W, bool RMS>
__device__ __forceinline__ void ln_bwd_block_impl(bf16_t* dinp, float* partial, const bf16_t* dout,
                                                  const bf16_t* inp, const bf16_t* w, const float* mean,
                                                  const float* rstd, int N, int C, int rows_per_block,
                                                  unsigned* amax) {
    static_assert(LN_BWD_SLOTS == 4, "two rows worked on, the next two in flight");
    constexpr int STRIDE = 8 * 32 * W;
    extern __shared__ uint4 ring[];              // [LN_BWD_SLOTS][x | dy | dx][J][blockDim]
    __shared__ float sums[2][4][W];              // [pair parity][a, bsum of row 0 | of row 1][warp]
    __shared__ float stats[2][LN_BWD_MAX_ROWS];  // the block's rows' mean and rstd (RMS: rstd only)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c0 = 8 * threadIdx.x;
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(N, r0 + rows_per_block);
    if (r0 >= N) return;  // the whole block: no barrier is left waiting
    unsigned am = 0;
    const int slot_len = 3 * J * blockDim.x;
    for (int k = 0; k < 2 && r0 + k < r1; ++k)
        ln_bwd_issue_row<J>(ring + k * slot_len, inp, dout, dinp, r0 + k, C, c0, STRIDE);
    cp_commit();
    for (int r = threadIdx.x; r < r1 - r0; r += blockDim.x) {
        if constexpr (!RMS) stats[0][r] = mean[r0 + r];
        stats[1][r] = rstd[r0 + r];
    }
    uint4 wv[J];
    float dwacc[J][8], dbacc[J][8];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        if (c0 + j * STRIDE < C) wv[j] = ld16(w + c0 + j * STRIDE);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            dwacc[j][k] = 0.f;
            dbacc[j][k] = 0.f;
        }
    }
    __syncthreads();  // stats
    for (int i = 0; r0 + i < r1; i += 2) {
        const int row = r0 + i, par = (i >> 1) & 1;
        const bool two = row + 1 < r1;  // the same for the whole block
        // The next pair into the slots the previous pair used (this thread read them last
        // iteration), then wait for this pair's copies: at most the newest group in flight.
        for (int k = 2; k < 4 && row + k < r1; ++k)
            ln_bwd_issue_row<J>(ring + ((i + k) % LN_BWD_SLOTS) * slot_len, inp, dout, dinp, row + k, C, c0, STRIDE);
        cp_commit();
        cp_wait<1>();
        const uint4* s0 = ring + (i % LN_BWD_SLOTS) * slot_len;
        const uint4* s1 = ring + ((i + 1) % LN_BWD_SLOTS) * slot_len;
        const float m0 = RMS ? 0.f : stats[0][i], q0 = stats[1][i];
        const float m1 = (two && !RMS) ? stats[0][i + 1] : 0.f, q1 = two ? stats[1][i + 1] : 0.f;
        float a0 = 0.f, b0 = 0.f, a1 = 0.f, b1 = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            if (c0 + j * STRIDE < C) {
                ln_bwd_chunk_sums<RMS>(ln_slot<J>(s0, 0, j), ln_slot<J>(s0, 1, j), wv[j], m0, q0, a0, b0);
                if (two) ln_bwd_chunk_sums<RMS>(ln_slot<J>(s1, 0, j), ln_slot<J>(s1, 1, j), wv[j], m1, q1, a1, b1);
            }
        }
        if constexpr (!RMS) a0 = warp_sum(a0);
        b0 = warp_sum(b0);
        if constexpr (!RMS) a1 = warp_sum(a1);
        b1 = warp_sum(b1);
        if (lane == 0) {
            if constexpr (!RMS) sums[par][0][warp] = a0;
            sums[par][1][warp] = b0;
            if constexpr (!RMS) sums[par][2][warp] = a1;
            sums[par][3][warp] = b1;
        }
        // One barrier per pair: the other parity's sums are rewritten only after the next
        // pair's barrier, which every thread reaches after reading these.
        __syncthreads();
        a0 = b0 = a1 = b1 = 0.f;
#pragma unroll
        for (int q = 0; q < W; ++q) {
            if constexpr (!RMS) a0 += sums[par][0][q];
            b0 += sums[par][1][q];
            if constexpr (!RMS) a1 += sums[par][2][q];
            b1 += sums[par][3][q];
        }
        if constexpr (!RMS) a0 /= C;
        b0 /= C;
        if constexpr (!RMS) a1 /= C;
        b1 /= C;
        bf16_t* dx = dinp + (long long)row * C;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = c0 + j * STRIDE;
            if (c < C) {
                const uint4 d = ln_bwd_chunk_apply<RMS>(ln_slot<J>(s0, 2, j), ln_slot<J>(s0, 0, j),
                                                        ln_slot<J>(s0, 1, j), wv[j], m0, q0, a0, b0, dwacc[j],
                                                        dbacc[j]);
                *(uint4*)(dx + c) = d;
                am = max_abs8(d, am);
            }
        }
        if (two) {
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const int c = c0 + j * STRIDE;
                if (c < C) {
                    const uint4 d = ln_bwd_chunk_apply<RMS>(ln_slot<J>(s1, 2, j), ln_slot<J>(s1, 0, j),
                                                            ln_slot<J>(s1, 1, j), wv[j], m1, q1, a1, b1, dwacc[j],
                                                            dbacc[j]);
                    *(uint4*)(dx + C + c) = d;
                    am = max_abs8(d, am);
                }
            }
        }
    }
    cp_wait<0>();  // no copy outlives the block (the trailing groups are empty)
    warp_amax_out(amax, am);
    float* p = partial + (long long)blockIdx.x * (RMS ? 1 : 2) * C;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * STRIDE;
        if (c < C) ln_bwd_chunk_store<RMS>(p, C, c, dwacc[j], dbacc[j]);
    }
}

// Instances: J = 1 with W = 1..4 warps (C <= 1024), then J = 2 with 4, 8, 12 and 16 warps
// (C <= 2048, 4096, 6144, 8192); layernorm.rs picks by C. Each for LayerNorm and RMSNorm
// (whose kernels take the same arguments; mean is not read).
#define LN_BWD_BLOCK(NAME, RMS, J, W)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * W) NAME##_bwd_j##J##w##W(                              \
        bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp, const bf16_t* w,                \
        const float* mean, const float* rstd, int N, int C, int rows_per_block, unsigned* amax) {            \
        ln_bwd_block_impl<J, W, RMS>(dinp, partial, dout, inp, w, mean, rstd, N, C, rows_per_block, amax);   \
    }
#define LN_BWD_BLOCKS(NAME, RMS)   \
    LN_BWD_BLOCK(NAME, RMS, 1, 1)  \
    LN_BWD_BLOCK(NAME, RMS, 1, 2)  \
    LN_BWD_BLOCK(NAME, RMS, 1, 3)  \
    LN_BWD_BLOCK(NAME, RMS, 1, 4)  \
    LN_BWD_BLOCK(NAME, RMS, 2, 4)  \
    LN_BWD_BLOCK(NAME, RMS, 2, 8)  \
    LN_BWD_BLOCK(NAME, RMS, 2, 12) \
    LN_BWD_BLOCK(NAME, RMS, 2, 16)
LN_BWD_BLOCKS(layernorm, false)
LN_BWD_BLOCKS(rmsnorm, true)

// RMSNorm forward, general: one warp per row (blockDim.x = 256, 8 rows per block), any C
// and alignment; the row is read twice (the mean square, then the output). The amax of out
// into *amax where it is not null (an FP8 amax sink), here and in the fast instances; a null
// out writes only rstd, and the amax where that is set (rmsnorm_stats: an FP8 cast applies
// the norm).
extern "C" __global__ void rmsnorm_fwd(bf16_t* out, float* rstd, const bf16_t* inp, const bf16_t* w, int N, int C,
                                       float eps, unsigned* amax) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const bf16_t* x = inp + (long long)row * C;
    bf16_t* o = out + (long long)row * C;
    float ss = 0.f;
    for (int c = lane; c < C; c += 32) {
        const float v = bf2f(x[c]);
        ss += v * v;
    }
    const float s = 1.f / sqrtf(warp_sum(ss) / C + eps);
    if (!out && !amax) {  // rstd alone (an FP8 cast applies the norm and predicts its scale)
        if (lane == 0) rstd[row] = s;
        return;
    }
    unsigned am = 0;
    for (int c = lane; c < C; c += 32) {
        const bf16_t y = f2bf(bf2f(x[c]) * s * bf2f(w[c]));
        if (out) o[c] = y;
        am = max(am, abs_bits(y));
    }
    warp_amax_out(amax, am);
    if (lane == 0) rstd[row] = s;
}

// RMSNorm forward, fast: C % 8 == 0, 16-byte aligned rows and weight. W warps per row and
// RMS_FWD_THREADS / (32 W) rows per block; each thread holds the J 16-byte chunks
// c = 8 * t + j * 256 * W of its row in registers (t its index within the row's warps),
// so x is read once and out written once. The mean square: each thread's chunks in order,
// warp_sum, then (W > 1) the row's warps in warp order through shared memory: a fixed
// order, the same bits on every run.
template <int J, int W>
__device__ __forceinline__ void rms_fwd_impl(bf16_t* out, float* rstd, const bf16_t* inp, const bf16_t* w, int N,
                                             int C, float eps, unsigned* amax) {
    constexpr int ROWS = RMS_FWD_THREADS / (32 * W);
    constexpr int STRIDE = 8 * 32 * W;
    static_assert(ROWS * 32 * W == RMS_FWD_THREADS, "whole rows per block");
    __shared__ float part[ROWS][W];
    const int t = threadIdx.x % (32 * W), r = threadIdx.x / (32 * W);
    const int row = blockIdx.x * ROWS + r;
    const bool live = row < N;  // threads of absent rows still reach the barrier
    const int c0 = 8 * t;
    const bf16_t* x = inp + (long long)row * C;
    uint4 xv[J];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * STRIDE;
        xv[j] = (live && c < C) ? ld16(x + c) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
        float f[8];
        unpack8(xv[j], f);
#pragma unroll
        for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
    }
    ss = warp_sum(ss);
    if constexpr (W > 1) {
        if ((threadIdx.x & 31) == 0) part[r][t >> 5] = ss;
        __syncthreads();
        ss = 0.f;
#pragma unroll
        for (int q = 0; q < W; ++q) ss += part[r][q];
    }
    if (!live) return;
    const float s = 1.f / sqrtf(ss / C + eps);
    if (!out && !amax) {  // rstd alone (an FP8 cast applies the norm and predicts its scale)
        if (t == 0) rstd[row] = s;
        return;
    }
    bf16_t* o = out + (long long)row * C;
    unsigned am = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * STRIDE;
        if (c < C) {
            float f[8], ww[8];
            unpack8(xv[j], f);
            unpack8(ld16(w + c), ww);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = f[k] * s * ww[k];
            const uint4 y = pack8(f);
            if (out) *(uint4*)(o + c) = y;
            am = max_abs8(y, am);
        }
    }
    warp_amax_out(amax, am);  // a row's warps are all live or all not: whole warps here
    if (t == 0) rstd[row] = s;
}

// Instances (layernorm.rs picks the first whose 256 * J * W columns hold the row): one warp
// a row up to C = 2048, then 2, 4 and 8 warps (C <= 3072, 4096, 6144, 8192, 16384).
#define RMS_FWD(J, W)                                                                                        \
    extern "C" __global__ void __launch_bounds__(RMS_FWD_THREADS) rmsnorm_fwd_j##J##w##W(                    \
        bf16_t* out, float* rstd, const bf16_t* inp, const bf16_t* w, int N, int C, float eps,               \
        unsigned* amax) {                                                                                    \
        rms_fwd_impl<J, W>(out, rstd, inp, w, N, C, eps, amax);                                              \
    }
RMS_FWD(1, 1)
RMS_FWD(2, 1)
RMS_FWD(4, 1)
RMS_FWD(8, 1)
RMS_FWD(6, 2)
RMS_FWD(8, 2)
RMS_FWD(6, 4)
RMS_FWD(8, 4)
RMS_FWD(8, 8)
