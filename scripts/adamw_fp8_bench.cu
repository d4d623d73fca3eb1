// The optimizer step of one GPT-2 1.5B block's four FP8 weights (qkv 4800×1600, proj
// 1600×1600, fc 6400×1600, fc2 1600×6400), timed outside the trainer on the GPU machine's nvcc:
//   base      adamw4 (the flat update, leaving each weight's amax), then the transposing cast
//             of each weight into its cached codes (what a step costs with
//             SHARDTRAIN_FP8_STEP_CODES=0)
//   flat      adamw4 alone (the floor: the update without any codes)
//   tTCxTR    adamw_fp8 with tiles of TC columns × TR rows (the update writing both layouts'
//             codes with a predicted scale, then its check), 64x128 being the trainer's
//   flatq     adamw4 writing the row-layout codes too (the predicted scale), +tr: then qt by a
//             transpose of the codes (the predictions as the tiles' runs left them: right)
// Each variant starts once from the same state and must write the same parameters, master
// weights and codes as base (printed as checksums), then runs 30 times (median printed).
// Built by scripts/adamw-fp8-variants.sh; the kernels are the trainer's own files.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <functional>
#include <cuda_runtime.h>
#include "common.cuh"
#include "adamw.cu"
#include "fp8.cu"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

template <int TC, int TR>
__global__ void __launch_bounds__(256) variant(bf16_t* __restrict__ params, float* __restrict__ master,
                                               float* __restrict__ m, float* __restrict__ v,
                                               const float* __restrict__ grads, const AdamWFp8 t, int mode, float lr,
                                               float beta1, float beta2, float eps, float bc1, float bc2, float gs) {
    adamw_fp8_body<TC, TR>(params, master, m, v, grads, t, mode, lr, beta1, beta2, eps, bc1, bc2, gs);
}

template <int TC, int TR>
__global__ void __launch_bounds__(256, 4) variant_lb4(bf16_t* __restrict__ params, float* __restrict__ master,
                                                      float* __restrict__ m, float* __restrict__ v,
                                                      const float* __restrict__ grads, const AdamWFp8 t, int mode,
                                                      float lr, float beta1, float beta2, float eps, float bc1,
                                                      float bc2, float gs) {
    adamw_fp8_body<TC, TR>(params, master, m, v, grads, t, mode, lr, beta1, beta2, eps, bc1, bc2, gs);
}

// adamw4 that also writes each segment's row-layout codes (q + segment offset) with the scale of
// the predicted amax *pred (one per segment here): +1 byte an element, the update still flat.
__global__ void adamw4_q(bf16_t* params, float* master, float* m, float* v, const float* grads, const AdamWSegs segs,
                         unsigned char* q, const unsigned* pred, float lr, float beta1, float beta2, float eps,
                         float bc1, float bc2, float grad_scale) {
    __shared__ unsigned block_amax[ADAMW_SEGS];
    adamw_block_amax_init(block_amax);
    const long long total = segs.start[segs.n];
    int s = 0;
    unsigned am = 0;
    float sc = fp8_scale(pred[4 * s], 0);
    for (long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < total;
         i += 4LL * gridDim.x * blockDim.x) {
        if (i >= segs.start[s + 1]) {
            adamw_flush_amax(block_amax, s, am);
            while (i >= segs.start[s + 1]) s++;
            sc = fp8_scale(pred[4 * s], 0);
        }
        const long long k = i - segs.start[s];
        const long long j = segs.moff[s] + k;
        const float4 g = *(const float4*)(grads + segs.goff[s] + k);
        float4 mi = *(const float4*)(m + j), vi = *(const float4*)(v + j), w = *(const float4*)(master + j);
        const float wd = segs.wd[s];
        w.x = adamw_update(g.x, mi.x, vi.x, w.x, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        w.y = adamw_update(g.y, mi.y, vi.y, w.y, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        w.z = adamw_update(g.z, mi.z, vi.z, w.z, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        w.w = adamw_update(g.w, mi.w, vi.w, w.w, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        *(float4*)(m + j) = mi;
        *(float4*)(v + j) = vi;
        *(float4*)(master + j) = w;
        const uint2 pb = {(unsigned)f2bf(w.x) | ((unsigned)f2bf(w.y) << 16),
                          (unsigned)f2bf(w.z) | ((unsigned)f2bf(w.w) << 16)};
        *(uint2*)(params + segs.poff[s] + k) = pb;
        am = max_abs_bits2(pb.x, max_abs_bits2(pb.y, am));
        const unsigned c0 = cvt2(bf2f(pb.x & 0xffff) * sc, bf2f(pb.x >> 16) * sc, 0);
        const unsigned c1 = cvt2(bf2f(pb.y & 0xffff) * sc, bf2f(pb.y >> 16) * sc, 0);
        *(unsigned*)(q + segs.poff[s] + k) = c0 | (c1 << 16);
    }
    adamw_flush_amax(block_amax, s, am);
    adamw_block_amax_out(block_amax, segs);
}

// qt [cols, rows] from q [rows, cols] (codes), by fp8.cu's tiles: 2 bytes an element.
__global__ void __launch_bounds__(256) codes_transpose(unsigned char* __restrict__ qt, const unsigned char* __restrict__ q,
                                                       int rows, int cols) {
    __shared__ Fp8TileWords t;
    const int tiles_c = (cols + FP8_TILE_C - 1) / FP8_TILE_C;
    const long long tiles = (long long)tiles_c * ((rows + FP8_TILE_R - 1) / FP8_TILE_R);
    const int cg = threadIdx.x & 7, g = threadIdx.x >> 3;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int r0 = (int)(tile / tiles_c) * FP8_TILE_R, c0 = (int)(tile % tiles_c) * FP8_TILE_C;
        const int gr = r0 + 4 * g, gc = c0 + 8 * cg;
        if (gr < rows && gc < cols) {
            uint2 b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) b[i] = *(const uint2*)(q + (long long)(gr + i) * cols + gc);
            fp8_tile_words(t, b, cg, g);
        }
        __syncthreads();
        fp8_tile_store_t(qt, t, r0, c0, rows, cols);
        __syncthreads();
    }
}

__global__ void fill(float* x, long long n, unsigned seed, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        x[i] = lo + (hi - lo) * (h >> 8) * (1.f / 16777216.f);
    }
}

static unsigned long long sum_bytes(const void* d, size_t n) {
    std::vector<unsigned char> h(n);
    CK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
    unsigned long long s = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) s = (s ^ h[i]) * 1099511628211ull;
    return s;
}

int main() {
    const int R[4] = {4800, 1600, 6400, 1600}, C[4] = {1600, 1600, 1600, 6400};
    long long off[5] = {0};
    for (int w = 0; w < 4; ++w) off[w + 1] = off[w] + (long long)R[w] * C[w];
    const long long n = off[4];
    float *master, *m, *v, *g, *m0, *v0, *w0;
    bf16_t* params;
    unsigned char *q, *qt;
    unsigned *slots, *preds;
    CK(cudaMalloc(&master, n * 4)); CK(cudaMalloc(&m, n * 4)); CK(cudaMalloc(&v, n * 4)); CK(cudaMalloc(&g, n * 4));
    CK(cudaMalloc(&w0, n * 4)); CK(cudaMalloc(&m0, n * 4)); CK(cudaMalloc(&v0, n * 4));
    CK(cudaMalloc(&params, n * 2)); CK(cudaMalloc(&q, n)); CK(cudaMalloc(&qt, n));
    CK(cudaMalloc(&slots, 4 * 16)); CK(cudaMalloc(&preds, 4 * 16));
    fill<<<1024, 256>>>(w0, n, 1, -0.05f, 0.05f);
    fill<<<1024, 256>>>(m0, n, 2, -1e-3f, 1e-3f);
    fill<<<1024, 256>>>(v0, n, 3, 1e-8f, 1e-6f);
    fill<<<1024, 256>>>(g, n, 4, -0.01f, 0.01f);
    CK(cudaDeviceSynchronize());
    const float lr = 6e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, bc1 = 0.5f, bc2 = 0.3f, gs = 0.7f;
    AdamWSegs segs = {};
    AdamWFp8 t = {};
    for (int w = 0; w < 4; ++w) {
        segs.start[w + 1] = off[w + 1];
        segs.poff[w] = segs.moff[w] = segs.goff[w] = off[w];
        segs.amax[w] = slots + 4 * w + 1;
        segs.wd[w] = 0.1f;
        t.poff[w] = t.moff[w] = t.goff[w] = off[w];
        t.q[w] = q + off[w];
        t.qt[w] = qt + off[w];
        t.slot[w] = slots + 4 * w;
        t.pred[w] = preds + 4 * w;
        t.rows[w] = R[w];
        t.cols[w] = C[w];
        t.wd[w] = 0.1f;
    }
    for (int k = 4; k <= ADAMW_SEGS; ++k) segs.start[k] = n;
    segs.n = 4;
    t.n = 4;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    auto tiles_of = [&](int tc, int tr) {
        AdamWFp8 u = t;
        for (int w = 0; w < 4; ++w) u.tile_start[w + 1] = u.tile_start[w] + (long long)((R[w] + tr - 1) / tr) * ((C[w] + tc - 1) / tc);
        return u;
    };
    auto base = [&](bool casts) {
        CK(cudaMemsetAsync(slots, 0, 64));
        adamw4<<<(int)std::min<long long>(n / 4 / 256 + 1, 132 * 16), 256>>>(params, master, m, v, g, segs, lr, b1, b2, eps, bc1, bc2, gs);
        if (!casts) return;
        for (int w = 0; w < 4; ++w) {
            const int tiles = ((R[w] + 127) / 128) * ((C[w] + 63) / 64);
            fp8_cast_transpose_bf16<<<tiles, 256>>>(q + off[w], qt + off[w], params + off[w], R[w], C[w], slots + 4 * w, 0,
                                                    nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, FP8_SCALE_OF_AMAX,
                                                    nullptr, nullptr);
        }
    };
    auto tiled = [&](auto kernel, int tc, int tr) {
        return [=](bool) {
            const AdamWFp8 u = tiles_of(tc, tr);
            const int tiles = (int)u.tile_start[4];
            CK(cudaMemsetAsync(slots, 0, 64));
            kernel<<<tiles, 256>>>(params, master, m, v, g, u, ADAMW_FP8_UPDATE, lr, b1, b2, eps, bc1, bc2, gs);
            kernel<<<std::min(tiles, 8 * sms), 256>>>(params, master, m, v, g, u, ADAMW_FP8_CHECK, lr, b1, b2, eps, bc1, bc2, gs);
        };
    };
    // Row codes from the update (predictions as the tiles' first run left them), then qt by a
    // transpose of the codes.
    auto flatq = [&](bool transpose) {
        CK(cudaMemsetAsync(slots, 0, 64));
        adamw4_q<<<(int)std::min<long long>(n / 4 / 256 + 1, 132 * 16), 256>>>(params, master, m, v, g, segs, q, preds, lr, b1, b2, eps, bc1, bc2, gs);
        if (!transpose) return;
        for (int w = 0; w < 4; ++w) {
            const int tiles = ((R[w] + 127) / 128) * ((C[w] + 63) / 64);
            codes_transpose<<<tiles, 256>>>(qt + off[w], q + off[w], R[w], C[w]);
        }
    };
    struct V { const char* name; std::function<void(bool)> run; };
    std::vector<V> vs = {
        {"base", base},
        {"flat", [&](bool) { base(false); }},
        {"t64x128", tiled(variant<64, 128>, 64, 128)},
        {"t128x64", tiled(variant<128, 64>, 128, 64)},
        {"t256x32", tiled(variant<256, 32>, 256, 32)},
        {"t64x128b4", tiled(variant_lb4<64, 128>, 64, 128)},
        {"t256x32b4", tiled(variant_lb4<256, 32>, 256, 32)},
        {"flatq", [&](bool) { flatq(false); }},
        {"flatq+tr", flatq},
    };
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    printf("one 1.5B block's four weights, %lld elements, %d SMs\n", n, sms);
    for (auto& var : vs) {
        CK(cudaMemcpy(master, w0, n * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(m, m0, n * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(v, v0, n * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemset(preds, 0, 64));
        var.run(true);
        CK(cudaDeviceSynchronize());
        const unsigned long long sp = sum_bytes(params, n * 2), sw = sum_bytes(master, n * 4), sq = sum_bytes(q, n), sqt = sum_bytes(qt, n);
        std::vector<float> ms;
        for (int it = 0; it < 33; ++it) {
            CK(cudaEventRecord(e0));
            var.run(true);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float x;
            CK(cudaEventElapsedTime(&x, e0, e1));
            if (it >= 3) ms.push_back(x);
        }
        std::sort(ms.begin(), ms.end());
        const int per = strcmp(var.name, "flat") == 0 ? 30 : strcmp(var.name, "flatq") == 0 ? 31 : 32;
        const double bytes = (double)n * per;
        printf("%-8s median %.3f ms (min %.3f)  %.2f TB/s at %d B/elem  params %016llx master %016llx q %016llx qt %016llx\n",
               var.name, ms[ms.size() / 2], ms[0], bytes / (ms[ms.size() / 2] * 1e-3) / 1e12,
               per, sp, sw, sq, sqt);
    }
    return 0;
}
