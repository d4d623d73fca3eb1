// Standalone timing of one attention forward kernel variant, built with nvcc on the GPU machine
// by scripts/attn-fwd-variants.sh (which passes SRC, KERNEL, HSZ, GRID_ROWS, SMEM, VARIANT).
// Multi-head shapes: the kernel's key/value head count (an argument since grouped-query
// attention) is NH; -DPRE_GQA times a copy of attention.cu from before it (no such argument).
#ifdef PRE_GQA
#define KV_ARGS(NH) NH
#else
#define KV_ARGS(NH) NH, NH
#endif
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cuda_runtime.h>
#define TILE 64
#define NTHREADS 256
#define LDP 80
#include "common.cuh"
#include SRC
int main(int argc, char** argv) {
    int B = atoi(argv[1]), NH = atoi(argv[2]), T = atoi(argv[3]);
    const int HS = HSZ, C = NH * HS;
    size_t n = (size_t)B * T * 3 * C;
    std::vector<unsigned short> h(n);
    srand(1);
    for (auto& x : h) { float f = (rand() / (float)RAND_MAX - 0.5f) * 2.f; unsigned u; memcpy(&u, &f, 4); x = u >> 16; }
    bf16_t *qkv, *out; float* lse;
    cudaMalloc(&qkv, n * 2); cudaMalloc(&out, (size_t)B * T * C * 2); cudaMalloc(&lse, (size_t)B * NH * T * 4);
    cudaMemcpy(qkv, h.data(), n * 2, cudaMemcpyHostToDevice);
    cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    dim3 grid((T + GRID_ROWS - 1) / GRID_ROWS, NH, B);
    float scale = 1.f / sqrtf((float)HS);
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 5; ++i) KERNEL<<<grid, 128, SMEM>>>(out, lse, qkv, T, KV_ARGS(NH), scale);
    std::vector<float> ts;
    for (int i = 0; i < 30; ++i) {
        cudaEventRecord(a); KERNEL<<<grid, 128, SMEM>>>(out, lse, qkv, T, KV_ARGS(NH), scale); cudaEventRecord(b);
        cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    double flop = 4.0 * B * NH * (double)T * T * HS / 2;
    cudaError_t e = cudaGetLastError();
    std::vector<unsigned short> ho((size_t)B * T * C);
    std::vector<float> hl((size_t)B * NH * T);
    cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hl.data(), lse, hl.size() * 4, cudaMemcpyDeviceToHost);
    double so = 0, sl = 0;
    for (auto x : ho) { unsigned u = (unsigned)x << 16; float f; memcpy(&f, &u, 4); so += fabs(f); }
    for (auto x : hl) sl += x;
    printf("%-8s B%d NH%d T%d HS%d: %.4f ms %.1f TFLOP/s  check %.6e %.6e %s\n", VARIANT, B, NH, T, HS, ts[15],
           flop / ts[15] / 1e9, so, sl, e == cudaSuccess ? "" : cudaGetErrorString(e));
}
