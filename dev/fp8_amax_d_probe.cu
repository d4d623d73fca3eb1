// Whether cuBLASLt's FP8 GEMMs with a bf16 output can report the output's amax
// (CUBLASLT_MATMUL_DESC_AMAX_D_POINTER) — plain and with the DGELU epilogue — and at what cost,
// at GPT-2 1.5B's fc2 dX GEMM (dX[8192, 6400] = dY[8192, 1600] · W[1600, 6400]; TN, e4m3 W,
// e5m2 dY). If it can, fc's output gradient GELU'(pre)·dX could get its exact amax from the
// GEMM instead of a predicted scale and a recast where the prediction misses.
// Build: nvcc -arch=sm_90 -O3 -std=c++17 -I<cublas include> fp8_amax_d_probe.cu -L<lib> -lcublasLt
// (here: PyPI's nvidia-cublas headers). On an H200 with CUDA 13.0 (BENCHMARKS.md run 27) the
// heuristic refused AMAX_D with a bf16 D (CUBLAS_STATUS_INVALID_VALUE, no algorithm), plain
// and with DGELU; the probe's own GEMM launches failed there (NOT_SUPPORTED: built against
// 13.10's headers, run on 13.0's library), so read only the heuristic's answers.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include "bench_util.cuh"

#define LT(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("%s: status %d\n", #x, (int)s); exit(1); } } while (0)

__global__ void fill_codes(unsigned char* p, long long n, unsigned seed) {
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
        unsigned b = (unsigned)(bench_unit(i, seed) * 256.f);
        p[i] = (unsigned char)((b & 0x3f) | (b & 0x80));  // small finite codes either sign
    }
}
__global__ void fill_bf16(__nv_bfloat16* p, long long n, unsigned seed) {
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += (long long)gridDim.x * 256)
        p[i] = __float2bfloat16(4.f * bench_unit(i, seed) - 2.f);
}

int main() {
    const int m = 6400, n = 8192, k = 1600;
    unsigned char *a, *b;
    __nv_bfloat16 *d, *aux;
    float *scales, *amax;
    void* ws;
    const size_t ws_bytes = 32u << 20;
    CK(cudaMalloc(&a, (size_t)m * k));
    CK(cudaMalloc(&b, (size_t)n * k));
    CK(cudaMalloc(&d, (size_t)m * n * 2));
    CK(cudaMalloc(&aux, (size_t)m * n * 2));
    CK(cudaMalloc(&scales, 16));
    CK(cudaMalloc(&amax, 16));
    CK(cudaMalloc(&ws, ws_bytes));
    fill_codes<<<1024, 256>>>(a, (long long)m * k, 1);
    fill_codes<<<1024, 256>>>(b, (long long)n * k, 2);
    fill_bf16<<<1024, 256>>>(aux, (long long)m * n, 3);
    const float ones[4] = {1.f, 0.25f, 1.f, 1.f};
    CK(cudaMemcpy(scales, ones, 16, cudaMemcpyHostToDevice));
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    cublasLtMatrixLayout_t la, lb, ld;
    LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k));
    LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E5M2, k, n, k));
    LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    const char* names[4] = {"plain", "amax_d", "dgelu", "dgelu+amax_d"};
    float best_plain = 0.f;
    for (int v = 0; v < 4; ++v) {
        const bool want_amax = v & 1, dgelu = v & 2;
        cublasLtMatmulDesc_t desc;
        LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        const float* sa = scales;
        const float* sb = scales + 1;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
        if (want_amax) {
            void* ap = amax;
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &ap, sizeof(ap)));
        }
        if (dgelu) {
            cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_DGELU;
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
            void* xp = aux;
            int64_t ldx = m;
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &xp, sizeof(xp)));
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldx, sizeof(ldx)));
        }
        cublasLtMatmulHeuristicResult_t res[16];
        int found = 0;
        cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 16, res, &found);
        printf("%-14s heuristic status %d, %d algorithms\n", names[v], (int)hs, found);
        float best = 1e9f;
        int ok_algos = 0;
        for (int i = 0; i < found; ++i) {
            const float alpha = 1.f, beta = 0.f;
            auto run = [&] {
                cublasStatus_t s = cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &res[i].algo, ws, ws_bytes, 0);
                if (s != CUBLAS_STATUS_SUCCESS) { printf("  algo %d: matmul status %d\n", i, (int)s); }
            };
            CK(cudaMemset(amax, 0xff, 4));
            cublasStatus_t s = cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &res[i].algo, ws, ws_bytes, 0);
            CK(cudaDeviceSynchronize());
            if (s != CUBLAS_STATUS_SUCCESS) { printf("  algo %d: matmul status %d\n", i, (int)s); continue; }
            ++ok_algos;
            if (want_amax && i == 0) {
                // The amax it wrote against max |D| read back.
                std::vector<__nv_bfloat16> h((size_t)m * n);
                CK(cudaMemcpy(h.data(), d, h.size() * 2, cudaMemcpyDeviceToHost));
                float mx = 0.f, got;
                for (auto x : h) mx = std::max(mx, fabsf(__bfloat162float(x)));
                CK(cudaMemcpy(&got, amax, 4, cudaMemcpyDeviceToHost));
                printf("  amax written %.6g, max |D| %.6g (%s)\n", got, mx, got == mx ? "equal" : "DIFFERENT");
            }
            BenchTimes t = time_ms(run, 20);
            best = std::min(best, t.median);
        }
        if (ok_algos) {
            if (v == 0) best_plain = best;
            printf("  fastest of %d: %.4f ms (%.0f TFLOP/s)%s\n", ok_algos, best, 2.0 * m * n * k / best / 1e9,
                   v ? (best_plain > 0 ? "" : "") : "");
            if (v && best_plain > 0) printf("  vs plain: %+.4f ms\n", best - best_plain);
        }
        LT(cublasLtMatmulDescDestroy(desc));
    }
    // The cost the epilogue replaces: GELU'(pre)·dX as its own pass reads 2 and writes 1 bf16 tensors.
    printf("bytes of one bf16 [8192, 6400]: %.1f MB\n", (double)m * n * 2 / 1e6);
    return 0;
}
