// GPT-2 1.5B's LayerNorms (8192 rows × 1600) timed outside the trainer, the trainer's kernels
// (layernorm.cu, reduce.cu) beside variants of them, on the GPU machine's nvcc:
//   forward, FP8 (no output: the statistics and the output's amax, the cast applies the norm)
//   and bf16 (the output written), as the trainer launches it (layernorm_fwd_r8: a warp a row
//   held in registers, 8 rows a block, at most 64 registers), the general kernel (the row read
//   three times), and with W warps a row (J 16-byte chunks a thread in registers, the warps'
//   sums through shared memory: rmsnorm_fwd_j*w*'s shape). (Before layernorm_fwd_r8, one
//   kernel held every width and the compiler gave it 96 registers: BENCHMARKS.md run 27.)
//   backward (reads x, dy and dx, adds into dx; partial dw/db rows, then reduce_partials) with
//   8 to 64 rows a block, and 8 warps a block of one chunk a thread.
// Prints the median of 30 runs and, per variant, the largest difference from the trainer's
// statistics, amax, dx and dw/db (0 where it gives the same bits).
// Built by dev/layernorm-variants.sh.
#include <cmath>
#include "bench_util.cuh"
#include "common.cuh"
#include "layernorm.cu"
#include "reduce.cu"

LN_BWD_BLOCK(bench_layernorm, false, 1, 8)

// W warps a row, ROWS = 256 / 32W rows a block, J chunks a thread held in registers. The
// mean: each thread's chunks in order, warp_sum, the row's warps in order; then the centred
// variance the same way.
template <int J, int W>
__global__ void __launch_bounds__(256) ln_fwd_multi(bf16_t* out, float* mean, float* rstd, const bf16_t* inp,
                                                     const bf16_t* w, const bf16_t* b, int N, int C,
                                                     unsigned* amax) {
    constexpr int ROWS = 256 / (32 * W), STRIDE = 8 * 32 * W;
    __shared__ float part[2][ROWS][W];
    const int t = threadIdx.x % (32 * W), r = threadIdx.x / (32 * W);
    const int row = blockIdx.x * ROWS + r;
    const bool live = row < N;
    const int c0 = 8 * t;
    const bf16_t* x = inp + (long long)row * C;
    uint4 xv[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * STRIDE;
        xv[j] = (live && c < C) ? ld16(x + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        float f[8];
        unpack8(xv[j], f);
#pragma unroll
        for (int k = 0; k < 8; ++k) s += f[k];
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[0][r][t >> 5] = s;
    __syncthreads();
    s = 0.f;
#pragma unroll
    for (int q = 0; q < W; ++q) s += part[0][r][q];
    const float m = s / C;
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        if (c0 + j * STRIDE < C) {
            float f[8];
            unpack8(xv[j], f);
#pragma unroll
            for (int k = 0; k < 8; ++k) v += (f[k] - m) * (f[k] - m);
        }
    }
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) part[1][r][t >> 5] = v;
    __syncthreads();
    v = 0.f;
#pragma unroll
    for (int q = 0; q < W; ++q) v += part[1][r][q];
    if (!live) return;
    const float rs = 1.f / sqrtf(v / C + LN_EPS);
    bf16_t* o = out ? out + (long long)row * C : nullptr;
    unsigned am = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = c0 + j * STRIDE;
        if (c < C) {
            float f[8], ww[8], bb[8];
            unpack8(xv[j], f);
            unpack8(ld16(w + c), ww);
            unpack8(ld16(b + c), bb);
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = (f[k] - m) * rs * ww[k] + bb[k];
            const uint4 y = pack8(f);
            if (o) *(uint4*)(o + c) = y;
            am = max_abs8(y, am);
        }
    }
    warp_amax_out(amax, am);
    if (t == 0) {
        mean[row] = m;
        rstd[row] = rs;
    }
}

__global__ void fill_bf(bf16_t* x, long long n, unsigned seed, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(lo + (hi - lo) * bench_unit(i, seed));
}

static float max_diff(const void* a, const void* b, size_t n, bool bf) {
    std::vector<unsigned short> ha(bf ? n : 0), hb(bf ? n : 0);
    std::vector<float> fa(bf ? 0 : n), fb(bf ? 0 : n);
    float d = 0.f;
    if (bf) {
        CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; ++i) {
            float x, y;
            unsigned ua = (unsigned)ha[i] << 16, ub = (unsigned)hb[i] << 16;
            memcpy(&x, &ua, 4); memcpy(&y, &ub, 4);
            d = std::max(d, fabsf(x - y));
        }
    } else {
        CK(cudaMemcpy(fa.data(), a, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(fb.data(), b, n * 4, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; ++i) d = std::max(d, fabsf(fa[i] - fb[i]));
    }
    return d;
}

int main() {
    const int N = 8192, C = 1600;
    const long long n = (long long)N * C;
    bf16_t *x, *wb, *out, *out0, *dy, *dx, *dx_init, *dx0;
    float *mean, *rstd, *mean0, *rstd0, *partial, *dwdb, *dwdb0;
    unsigned *amax;
    CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&out, n * 2)); CK(cudaMalloc(&out0, n * 2));
    CK(cudaMalloc(&dy, n * 2)); CK(cudaMalloc(&dx, n * 2)); CK(cudaMalloc(&dx_init, n * 2)); CK(cudaMalloc(&dx0, n * 2));
    CK(cudaMalloc(&wb, 2 * C * 2));
    CK(cudaMalloc(&mean, N * 4)); CK(cudaMalloc(&rstd, N * 4)); CK(cudaMalloc(&mean0, N * 4)); CK(cudaMalloc(&rstd0, N * 4));
    CK(cudaMalloc(&partial, (size_t)1024 * 2 * C * 4)); CK(cudaMalloc(&dwdb, 2 * C * 4)); CK(cudaMalloc(&dwdb0, 2 * C * 4));
    CK(cudaMalloc(&amax, 16));
    fill_bf<<<1024, 256>>>(x, n, 1, -3.f, 3.f);
    fill_bf<<<1024, 256>>>(wb, 2 * C, 2, 0.5f, 1.5f);
    fill_bf<<<1024, 256>>>(dy, n, 3, -0.01f, 0.01f);
    fill_bf<<<1024, 256>>>(dx_init, n, 4, -0.01f, 0.01f);
    const bf16_t *w = wb, *b = wb + C;
    unsigned amax0 = 0;
    printf("LayerNorm forward, %d x %d (26 MB read; bf16 also writes 26 MB)\n", N, C);
    for (int with_out = 0; with_out < 2; ++with_out) {
        bf16_t* o = with_out ? out : nullptr;
        unsigned* am = with_out ? nullptr : amax;
        struct V { const char* name; std::function<void()> f; };
        std::vector<V> vs = {
            {"trainer (layernorm_fwd_r8)", [&] { layernorm_fwd_r8<<<N / 8, 256>>>(o, mean, rstd, x, w, b, N, C, am); }},
            {"general (row read 3 times)", [&] { layernorm_fwd<<<N / 8, 256>>>(o, mean, rstd, x, w, b, N, C, am); }},
            {"2 warps a row, j4", [&] { ln_fwd_multi<4, 2><<<N / 4, 256>>>(o, mean, rstd, x, w, b, N, C, am); }},
            {"4 warps a row, j2", [&] { ln_fwd_multi<2, 4><<<N / 2, 256>>>(o, mean, rstd, x, w, b, N, C, am); }},
            {"1 warp a row, j7 (this code)", [&] { ln_fwd_multi<7, 1><<<N / 8, 256>>>(o, mean, rstd, x, w, b, N, C, am); }},
        };
        printf(" %s\n", with_out ? "bf16 (output written)" : "FP8 (statistics and amax only)");
        for (size_t k = 0; k < vs.size(); ++k) {
            CK(cudaMemset(amax, 0, 4));
            vs[k].f();
            CK(cudaDeviceSynchronize());
            unsigned a;
            CK(cudaMemcpy(&a, amax, 4, cudaMemcpyDeviceToHost));
            if (k == 0) {
                CK(cudaMemcpy(mean0, mean, N * 4, cudaMemcpyDeviceToDevice));
                CK(cudaMemcpy(rstd0, rstd, N * 4, cudaMemcpyDeviceToDevice));
                if (with_out) CK(cudaMemcpy(out0, out, n * 2, cudaMemcpyDeviceToDevice));
                amax0 = a;
            }
            const float dm = max_diff(mean, mean0, N, false), dr = max_diff(rstd, rstd0, N, false);
            const float dout = with_out ? max_diff(out, out0, n, true) : 0.f;
            BenchTimes t = time_ms(vs[k].f, 30);
            const double gb = (with_out ? 2.0 : 1.0) * n * 2 / 1e9;
            printf("  %-32s %8.4f ms %5.2f TB/s  mean/rstd/out diff %.3g %.3g %.3g  amax %s\n", vs[k].name, t.median,
                   gb / t.median, dm, dr, dout, with_out ? "-" : (a == amax0 ? "same" : "DIFFERENT"));
        }
    }
    // Backward: the statistics of the trainer's forward.
    layernorm_fwd_r8<<<N / 8, 256>>>(nullptr, mean, rstd, x, w, b, N, C, nullptr);
    printf("LayerNorm backward, %d x %d (x, dy, dx read, dx written: 105 MB), then reduce_partials\n", N, C);
    const int cfg_rows[6] = {16, 8, 32, 64, 16, 32};  // the first: the trainer's at N = 8192
    for (int k = 0; k < 6; ++k) {
        const int rows = cfg_rows[k];
        const bool w8 = k >= 4;
        const int nparts = (N + rows - 1) / rows, threads = w8 ? 256 : 128, J = w8 ? 1 : 2;
        const size_t smem = (size_t)LN_BWD_SLOTS * 3 * J * threads * 16;
        auto kern = w8 ? bench_layernorm_bwd_j1w8 : layernorm_bwd_j2w4;
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        auto run = [&] {
            kern<<<nparts, threads, smem>>>(dx, partial, dy, x, w, mean, rstd, N, C, rows, amax);
            reduce_partials<<<(2 * C + 31) / 32, dim3(32, RP_ROWS)>>>(dwdb, dwdb + C, C, partial, nparts, 2 * C, 1);
        };
        CK(cudaMemcpy(dx, dx_init, n * 2, cudaMemcpyDeviceToDevice));
        run();
        CK(cudaDeviceSynchronize());
        if (k == 0) {
            CK(cudaMemcpy(dx0, dx, n * 2, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(dwdb0, dwdb, 2 * C * 4, cudaMemcpyDeviceToDevice));
        }
        const float ddx = max_diff(dx, dx0, n, true), dw = max_diff(dwdb, dwdb0, 2 * C, false);
        // Timed runs add into dx again and again (its values drift; the bytes moved do not).
        BenchTimes t = time_ms(run, 30);
        printf("  %-6s %2d rows a block (%4d blocks) %8.4f ms %5.2f TB/s  dx/dwdb diff vs 16 rows %.3g %.3g\n",
               w8 ? "j1w8" : "j2w4", rows, nparts, t.median, 4.0 * n * 2 / 1e9 / t.median, ddx, dw);
    }
    return 0;
}
