// LayerNorm (twin of cpu/layernorm.rs). Statistics in fp32, two passes over the row
// (mean, then the centred variance) as the CPU reference does.
//
// Backward is deterministic: each block owns a fixed chunk of rows and writes its
// partial dw/db sums to a scratch array, which reduce_partials (reduce.cu) then adds up
// in chunk order. No atomics.

// LN_EPS (cpu::LN_EPS) and LN_WIDE_WARPS (layernorm.rs) come from the launch code as -D options.

// One warp per row; blockDim.x = 256 (8 rows per block).
extern "C" __global__ void layernorm_fwd(bf16_t* out, float* mean, float* rstd, const bf16_t* inp,
                                         const bf16_t* w, const bf16_t* b, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const bf16_t* x = inp + (long long)row * C;
    bf16_t* o = out + (long long)row * C;
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
    if (vec) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8], ww[8], bb[8];
            unpack8(*(const uint4*)(x + c), f);
            unpack8(*(const uint4*)(w + c), ww);
            unpack8(*(const uint4*)(b + c), bb);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = (f[k] - m) * r * ww[k] + bb[k];
            *(uint4*)(o + c) = pack8(f);
        }
    } else {
        for (int c = lane; c < C; c += 32) o[c] = f2bf((bf2f(x[c]) - m) * r * bf2f(w[c]) + bf2f(b[c]));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// Block k handles rows [k*rows_per_block, ...). dinp += (overwritten with the sum),
// partial[k] = [dw (C) | db (C)] for the block's rows. Dynamic shared memory: 2*C floats.
extern "C" __global__ void layernorm_bwd(bf16_t* dinp, float* partial, const bf16_t* dout,
                                         const bf16_t* inp, const bf16_t* w, const float* mean,
                                         const float* rstd, int N, int C, int rows_per_block) {
    extern __shared__ float sacc[];  // [dw (C) | db (C)], slot c owned by thread c % blockDim
    __shared__ float red[32];
    float* dw_acc = sacc;
    float* db_acc = sacc + C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        dw_acc[c] = 0.f;
        db_acc[c] = 0.f;
    }
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(N, r0 + rows_per_block);
    for (int row = r0; row < r1; ++row) {
        const bf16_t* x = inp + (long long)row * C;
        const bf16_t* dy = dout + (long long)row * C;
        bf16_t* dx = dinp + (long long)row * C;
        const float m = mean[row], s = rstd[row];
        float a = 0.f, bsum = 0.f;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float norm = (bf2f(x[c]) - m) * s;
            const float dn = bf2f(w[c]) * bf2f(dy[c]);
            a += dn;
            bsum += dn * norm;
        }
        a = block_sum(a, red) / C;
        bsum = block_sum(bsum, red) / C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float g = bf2f(dy[c]);
            const float norm = (bf2f(x[c]) - m) * s;
            const float dn = bf2f(w[c]) * g;
            db_acc[c] += g;
            dw_acc[c] += norm * g;
            dx[c] = f2bf(bf2f(dx[c]) + (dn - a - norm * bsum) * s);
        }
    }
    float* p = partial + (long long)blockIdx.x * 2 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        p[c] = dw_acc[c];
        p[C + c] = db_acc[c];
    }
}

// The 16-byte-chunk steps the rows and wide backward kernels share, on chunks already
// loaded (8 bf16 values of x, dy and w at one column, and of the row's dx). Chunk of a row
// with mean m and rstd s: its contribution to the row's two sums, a += w*dy and
// bsum += w*dy*norm;
__device__ __forceinline__ void ln_bwd_chunk_sums(uint4 xv, uint4 gv, uint4 wv, float m, float s, float& a,
                                                  float& bsum) {
    float xf[8], gf[8], wf[8];
    unpack8(xv, xf);
    unpack8(gv, gf);
    unpack8(wv, wf);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float dn = wf[k] * gf[k];
        a += dn;
        bsum += dn * ((xf[k] - m) * s);
    }
}

// with the row's a and bsum (already divided by C): dx plus its gradient (returned), and
// the chunk's dw/db accumulated into dwacc/dbacc (8 values each);
__device__ __forceinline__ uint4 ln_bwd_chunk_apply(uint4 dxv, uint4 xv, uint4 gv, uint4 wv, float m, float s,
                                                    float a, float bsum, float* dwacc, float* dbacc) {
    float xf[8], gf[8], wf[8], df[8];
    unpack8(xv, xf);
    unpack8(gv, gf);
    unpack8(wv, wf);
    unpack8(dxv, df);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float norm = (xf[k] - m) * s;
        const float dn = wf[k] * gf[k];
        dbacc[k] += gf[k];
        dwacc[k] += norm * gf[k];
        df[k] += (dn - a - norm * bsum) * s;
    }
    return pack8(df);
}

// and a chunk's accumulated dw/db written to p = [dw (C) | db (C)] at column c (a partial
// row, or a warp's row of the block's shared sums).
__device__ __forceinline__ void ln_bwd_chunk_store(float* p, int C, int c, const float* dwacc, const float* dbacc) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        p[c + k] = dwacc[k];
        p[C + c + k] = dbacc[k];
    }
}

__device__ __forceinline__ uint4 ld16(const bf16_t* p) { return *(const uint4*)p; }

// Fast backward for C % 8 == 0, C <= 256 J, 16-byte aligned rows: J = ceil(C / 256)
// chunks of 8 values per lane (a template parameter, so registers hold exactly the
// chunks a row has). A block of warps, each a run of rows_per_warp rows with warp-level
// reductions only; up to 4 chunks, the row's x and dy stay in registers (packed bf16)
// between its two passes and w's for the whole run. Each warp accumulates dw/db in registers; the
// block adds its warps' sums in warp order through shared memory ([warps][2C] floats)
// and writes them as partial row `blockIdx.x`; reduce_partials then adds the partial rows
// in order: deterministic, no atomics, the same bits on every GPU.
template <int J>
__device__ __forceinline__ void ln_bwd_rows_impl(bf16_t* dinp, float* partial, const bf16_t* dout,
                                                 const bf16_t* inp, const bf16_t* w, const float* mean,
                                                 const float* rstd, int N, int C, int rows_per_warp) {
    extern __shared__ float wsum[];  // [warp][dw (C) | db (C)]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int r0 = (blockIdx.x * nw + warp) * rows_per_warp;
    const int r1 = min(N, r0 + rows_per_warp);  // a warp past the last row adds zeros
    // Up to 4 chunks the row's x, dy and w stay in registers; wider rows re-read them in
    // the second pass (from L1), which keeps the registers for more warps in flight.
    constexpr bool KEEP = J <= 4;
    uint4 wv[KEEP ? J : 1];
    float dwacc[J][8], dbacc[J][8];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = lane * 8 + j * 256;
        if constexpr (KEEP)
            if (c < C) wv[j] = ld16(w + c);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            dwacc[j][k] = 0.f;
            dbacc[j][k] = 0.f;
        }
    }
    for (int row = r0; row < r1; ++row) {
        const bf16_t* x = inp + (long long)row * C;
        const bf16_t* dy = dout + (long long)row * C;
        bf16_t* dx = dinp + (long long)row * C;
        const float m = mean[row], s = rstd[row];
        uint4 xv[KEEP ? J : 1], gv[KEEP ? J : 1];
        float a = 0.f, bsum = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = lane * 8 + j * 256;
            if (c >= C) continue;
            if constexpr (KEEP) {
                xv[j] = ld16(x + c);
                gv[j] = ld16(dy + c);
                ln_bwd_chunk_sums(xv[j], gv[j], wv[j], m, s, a, bsum);
            } else {
                ln_bwd_chunk_sums(ld16(x + c), ld16(dy + c), ld16(w + c), m, s, a, bsum);
            }
        }
        a = warp_sum(a) / C;
        bsum = warp_sum(bsum) / C;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = lane * 8 + j * 256;
            if (c >= C) continue;
            const uint4 dxv = ld16(dx + c);
            if constexpr (KEEP)
                *(uint4*)(dx + c) = ln_bwd_chunk_apply(dxv, xv[j], gv[j], wv[j], m, s, a, bsum, dwacc[j], dbacc[j]);
            else
                *(uint4*)(dx + c) = ln_bwd_chunk_apply(dxv, ld16(x + c), ld16(dy + c), ld16(w + c), m, s, a, bsum,
                                                       dwacc[j], dbacc[j]);
        }
    }
    float* mine = wsum + warp * 2 * C;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = lane * 8 + j * 256;
        if (c < C) ln_bwd_chunk_store(mine, C, c, dwacc[j], dbacc[j]);
    }
    __syncthreads();
    float* p = partial + (long long)blockIdx.x * 2 * C;
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        float v = 0.f;
        for (int k = 0; k < nw; ++k) v += wsum[k * 2 * C + c];
        p[c] = v;
    }
}

#define LN_BWD_ROWS(J)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) layernorm_bwd_rows##J(                                 \
        bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp, const bf16_t* w,                \
        const float* mean, const float* rstd, int N, int C, int rows_per_warp) {                             \
        ln_bwd_rows_impl<J>(dinp, partial, dout, inp, w, mean, rstd, N, C, rows_per_warp);                   \
    }
LN_BWD_ROWS(1)
LN_BWD_ROWS(2)
LN_BWD_ROWS(3)
LN_BWD_ROWS(4)
LN_BWD_ROWS(5)
LN_BWD_ROWS(6)
LN_BWD_ROWS(7)
LN_BWD_ROWS(8)

// Wide backward, for the rows the rows kernel cannot hold (2048 < C <= 8 * 8 * 32 *
// LN_WIDE_WARPS, C % 8 == 0, 16-byte aligned rows): a block of LN_WIDE_WARPS warps per
// group of rows, each thread holding the J = ceil(C / (8 * blockDim.x)) 16-byte chunks
// c = 8 * tid + j * 8 * blockDim.x (J a template parameter, as in the rows kernel). A
// row's two sums go warp_sum, then across the block's warps through shared memory in warp
// order (deterministic), double-buffered by row parity so each row costs one barrier.
// dw/db accumulate in registers and leave as partial row `blockIdx.x` for reduce_partials.
template <int J>
__device__ __forceinline__ void ln_bwd_wide_impl(bf16_t* dinp, float* partial, const bf16_t* dout,
                                                 const bf16_t* inp, const bf16_t* w, const float* mean,
                                                 const float* rstd, int N, int C, int rows_per_block) {
    __shared__ float sums[2][2][LN_WIDE_WARPS];  // [row parity][a | bsum][warp]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int stride = 8 * blockDim.x;
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(N, r0 + rows_per_block);
    float dwacc[J][8], dbacc[J][8];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            dwacc[j][k] = 0.f;
            dbacc[j][k] = 0.f;
        }
    for (int row = r0; row < r1; ++row) {
        const int par = (row - r0) & 1;
        const bf16_t* x = inp + (long long)row * C;
        const bf16_t* dy = dout + (long long)row * C;
        bf16_t* dx = dinp + (long long)row * C;
        const float m = mean[row], s = rstd[row];
        float a = 0.f, bsum = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = 8 * threadIdx.x + j * stride;
            if (c < C) ln_bwd_chunk_sums(ld16(x + c), ld16(dy + c), ld16(w + c), m, s, a, bsum);
        }
        a = warp_sum(a);
        bsum = warp_sum(bsum);
        if (lane == 0) {
            sums[par][0][warp] = a;
            sums[par][1][warp] = bsum;
        }
        // One barrier per row: the other parity's slots are rewritten only after the next
        // row's barrier, which every thread reaches after reading these.
        __syncthreads();
        a = 0.f;
        bsum = 0.f;
#pragma unroll
        for (int k = 0; k < LN_WIDE_WARPS; ++k) {
            a += sums[par][0][k];
            bsum += sums[par][1][k];
        }
        a /= C;
        bsum /= C;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = 8 * threadIdx.x + j * stride;
            if (c < C)
                *(uint4*)(dx + c) = ln_bwd_chunk_apply(ld16(dx + c), ld16(x + c), ld16(dy + c), ld16(w + c), m, s, a,
                                                       bsum, dwacc[j], dbacc[j]);
        }
    }
    if (r0 >= N) return;  // a block past the last row writes no partial row
    float* p = partial + (long long)blockIdx.x * 2 * C;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = 8 * threadIdx.x + j * stride;
        if (c < C) ln_bwd_chunk_store(p, C, c, dwacc[j], dbacc[j]);
    }
}

#define LN_BWD_WIDE(J)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * LN_WIDE_WARPS) layernorm_bwd_wide##J(                  \
        bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp, const bf16_t* w,                \
        const float* mean, const float* rstd, int N, int C, int rows_per_block) {                            \
        ln_bwd_wide_impl<J>(dinp, partial, dout, inp, w, mean, rstd, N, C, rows_per_block);                  \
    }
LN_BWD_WIDE(3)
LN_BWD_WIDE(4)
LN_BWD_WIDE(5)
LN_BWD_WIDE(6)
LN_BWD_WIDE(7)
LN_BWD_WIDE(8)
