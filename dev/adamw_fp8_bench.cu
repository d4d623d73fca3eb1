// The optimizer step of one GPT-2 1.5B block's four FP8 weights (qkv 4800×1600, proj
// 1600×1600, fc 6400×1600, fc2 1600×6400), timed outside the trainer on the GPU machine's nvcc:
//   base      adamw4 (the flat update, leaving each weight's amax), then the transposing cast
//             of each weight into its cached codes (what a step cost before the step wrote
//             the codes: BENCHMARKS.md's "Decided")
//   flat      adamw4 alone (the floor: the update without any codes)
//   codes     adamw4 writing the codes as laid out too (a predicted scale), then fp8_step_codes
//             over the four weights (the check, and the transposed codes from them): the
//             trainer's step
// Each variant starts once from the same state and must write the same parameters, master
// weights and codes as base (printed as checksums; "codes" predicts nothing the first time and
// casts again, then its timed runs predict right), then runs 30 times (median printed).
// Built by dev/adamw-fp8-variants.sh; the kernels are the trainer's own files. (The commit
// before this file's current form also timed an update by tiles writing both layouts itself:
// BENCHMARKS.md run 26.)
#include <cstring>
#include "bench_util.cuh"
#include "common.cuh"
#include "adamw.cu"
#include "fp8.cu"

__global__ void fill(float* x, long long n, unsigned seed, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = lo + (hi - lo) * bench_unit(i, seed);
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
    AdamWSegs segs = {}, coded = {};
    for (int w = 0; w < 4; ++w) {
        segs.start[w + 1] = off[w + 1];
        segs.poff[w] = segs.moff[w] = segs.goff[w] = off[w];
        segs.amax[w] = slots + 4 * w + 1;
        segs.wd[w] = 0.1f;
    }
    for (int k = 4; k <= ADAMW_SEGS; ++k) segs.start[k] = n;
    segs.n = 4;
    coded = segs;
    for (int w = 0; w < 4; ++w) {
        coded.codes[w] = q + off[w];
        coded.pred[w] = preds + 4 * w;
    }
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int grid4 = (int)std::min<long long>(n / 4 / 256 + 1, 132 * 16);
    auto cast_all = [&](int mode) {
        for (int w = 0; w < 4; ++w) {
            const int tiles = ((R[w] + 127) / 128) * ((C[w] + 63) / 64);
            fp8_cast_transpose_bf16<<<tiles, 256>>>(q + off[w], qt + off[w], params + off[w], R[w], C[w], slots + 4 * w, 0,
                                                    nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, mode,
                                                    preds + 4 * w, nullptr, 0);
        }
    };
    auto base = [&](bool casts) {
        CK(cudaMemsetAsync(slots, 0, 64));
        adamw4<<<grid4, 256>>>(params, master, m, v, g, segs, lr, b1, b2, eps, bc1, bc2, gs);
        if (casts) cast_all(FP8_SCALE_OF_AMAX);
    };
    Fp8StepCodes sc = {};
    for (int w = 0; w < 4; ++w) {
        sc.tile_start[w + 1] = sc.tile_start[w] + (long long)((R[w] + 255) / 256) * ((C[w] + 63) / 64);
        sc.q[w] = q + off[w];
        sc.qt[w] = qt + off[w];
        sc.x[w] = params + off[w];
        sc.slot[w] = slots + 4 * w;
        sc.pred[w] = preds + 4 * w;
        sc.rows[w] = R[w];
        sc.cols[w] = C[w];
    }
    sc.n = 4;
    auto with_codes = [&](bool) {
        CK(cudaMemsetAsync(slots, 0, 64));
        adamw4<<<grid4, 256>>>(params, master, m, v, g, coded, lr, b1, b2, eps, bc1, bc2, gs);
        fp8_step_codes<<<(int)sc.tile_start[4], 256>>>(sc);
    };
    struct V { const char* name; std::function<void(bool)> run; };
    std::vector<V> vs = {
        {"base", base},
        {"flat", [&](bool) { base(false); }},
        {"codes", with_codes},
    };
    printf("one 1.5B block's four weights, %lld elements, %d SMs\n", n, sms);
    for (auto& var : vs) {
        CK(cudaMemcpy(master, w0, n * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(m, m0, n * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(v, v0, n * 4, cudaMemcpyDeviceToDevice));
        CK(cudaMemset(preds, 0, 64));
        var.run(true);
        CK(cudaDeviceSynchronize());
        const unsigned long long sp = sum_bytes(params, n * 2), sw = sum_bytes(master, n * 4), sq = sum_bytes(q, n), sqt = sum_bytes(qt, n);
        const BenchTimes t = time_ms([&] { var.run(true); }, 30);
        const int per = strcmp(var.name, "flat") == 0 ? 30 : 32;
        const double bytes = (double)n * per;
        printf("%-8s median %.3f ms (min %.3f)  %.2f TB/s at %d B/elem  params %016llx master %016llx q %016llx qt %016llx\n",
               var.name, t.median, t.min, bytes / (t.median * 1e-3) / 1e12,
               per, sp, sw, sq, sqt);
    }
    return 0;
}
