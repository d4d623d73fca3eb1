// LayerNorm (twin of cpu/layernorm.rs). Statistics in fp32, two passes over the row
// (mean, then the centred variance) as the CPU reference does.
//
// Backward is deterministic: each block owns a fixed chunk of rows and writes its
// partial dw/db sums to a scratch array, which reduce_partials (reduce.cu) then adds up
// in chunk order. No atomics.

// LN_EPS (cpu::LN_EPS) comes from the launch code as a -D option.

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

// The 16-byte-chunk steps of the fast backward, on chunks already loaded (8 bf16 values of x, dy and w at one column, and of the row's dx). Chunk of a row
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
// row).
__device__ __forceinline__ void ln_bwd_chunk_store(float* p, int C, int c, const float* dwacc, const float* dbacc) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        p[c + k] = dwacc[k];
        p[C + c + k] = dbacc[k];
    }
}

__device__ __forceinline__ uint4 ld16(const bf16_t* p) { return *(const uint4*)p; }

// Fast backward for C % 8 == 0, C <= 8192, 16-byte aligned rows: a block of W warps per
// run of rows, each thread holding the J 16-byte chunks c = 8 * tid + j * 256 * W of a
// row (J and W template parameters, so registers hold exactly the chunks a row has). Per
// row: x, dy and the dx being accumulated are loaded together (one trip to memory), the
// row's two sums go warp_sum, then across the block's warps through shared memory in warp
// order (deterministic), double-buffered by row parity so each row costs one barrier. The
// next row's loads are issued before this row's arithmetic (software pipelining: a block
// never waits on memory with nothing in flight), which fits the registers up to two
// chunks a thread (127 registers), so wide rows take more warps; w stays in registers for
// the whole run. dw/db accumulate in registers and leave as
// partial row `blockIdx.x`; reduce_partials then adds the partial rows in order:
// deterministic, no atomics, the same bits on every GPU.
template <int J>
__device__ __forceinline__ void ln_bwd_load_row(const bf16_t* x, const bf16_t* dy, const bf16_t* dx, int C, int c0,
                                                int stride, uint4 (&xv)[J], uint4 (&gv)[J], uint4 (&dv)[J]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * stride;
        if (c < C) {
            xv[j] = ld16(x + c);
            gv[j] = ld16(dy + c);
            dv[j] = ld16(dx + c);
        }
    }
}

template <int J, int W>
__device__ __forceinline__ void ln_bwd_block_impl(bf16_t* dinp, float* partial, const bf16_t* dout,
                                                  const bf16_t* inp, const bf16_t* w, const float* mean,
                                                  const float* rstd, int N, int C, int rows_per_block) {
    static_assert(J <= 2, "two rows' chunks in registers");
    constexpr int STRIDE = 8 * 32 * W;
    __shared__ float sums[2][2][W];  // [row parity][a | bsum][warp]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c0 = 8 * threadIdx.x;
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(N, r0 + rows_per_block);
    if (r0 >= N) return;  // the whole block: no barrier is left waiting
    uint4 wv[J], xv[J], gv[J], dv[J];
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
    const long long C64 = C;
    ln_bwd_load_row<J>(inp + r0 * C64, dout + r0 * C64, dinp + r0 * C64, C, c0, STRIDE, xv, gv, dv);
    float m = mean[r0], s = rstd[r0];
    for (int row = r0; row < r1; ++row) {
        const int par = (row - r0) & 1;
        const bool more = row + 1 < r1;
        uint4 xn[J], gn[J], dn[J];
        float mn = 0.f, sn = 0.f;
        if (more) {
            const long long o = (row + 1) * C64;
            ln_bwd_load_row<J>(inp + o, dout + o, dinp + o, C, c0, STRIDE, xn, gn, dn);
            mn = mean[row + 1];
            sn = rstd[row + 1];
        }
        float a = 0.f, bsum = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j)
            if (c0 + j * STRIDE < C) ln_bwd_chunk_sums(xv[j], gv[j], wv[j], m, s, a, bsum);
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
        for (int k = 0; k < W; ++k) {
            a += sums[par][0][k];
            bsum += sums[par][1][k];
        }
        a /= C;
        bsum /= C;
        bf16_t* dx = dinp + row * C64;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int c = c0 + j * STRIDE;
            if (c < C)
                *(uint4*)(dx + c) = ln_bwd_chunk_apply(dv[j], xv[j], gv[j], wv[j], m, s, a, bsum, dwacc[j], dbacc[j]);
        }
#pragma unroll
        for (int j = 0; j < J; ++j) {
            xv[j] = xn[j];
            gv[j] = gn[j];
            dv[j] = dn[j];
        }
        m = mn;
        s = sn;
    }
    float* p = partial + (long long)blockIdx.x * 2 * C;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * STRIDE;
        if (c < C) ln_bwd_chunk_store(p, C, c, dwacc[j], dbacc[j]);
    }
}

// Instances: J = 1 with W = 1..4 warps (C <= 1024), then J = 2 with 4, 8, 12 and 16 warps
// (C <= 2048, 4096, 6144, 8192); layernorm.rs picks by C.
#define LN_BWD_BLOCK(J, W)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * W) layernorm_bwd_j##J##w##W(                           \
        bf16_t* dinp, float* partial, const bf16_t* dout, const bf16_t* inp, const bf16_t* w,                \
        const float* mean, const float* rstd, int N, int C, int rows_per_block) {                            \
        ln_bwd_block_impl<J, W>(dinp, partial, dout, inp, w, mean, rstd, N, C, rows_per_block);              \
    }
LN_BWD_BLOCK(1, 1)
LN_BWD_BLOCK(1, 2)
LN_BWD_BLOCK(1, 3)
LN_BWD_BLOCK(1, 4)
LN_BWD_BLOCK(2, 4)
LN_BWD_BLOCK(2, 8)
LN_BWD_BLOCK(2, 12)
LN_BWD_BLOCK(2, 16)
