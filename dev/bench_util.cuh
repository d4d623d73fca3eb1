// What the standalone CUDA benches (dev/*_bench.cu) share: error checks, deterministic
// fill values, checksums of device memory, and medians of timed runs.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// A value in [0, 1) from element i and a seed (a hash: the same on every run and machine).
__device__ __forceinline__ float bench_unit(long long i, unsigned seed) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    return (h >> 8) * (1.f / 16777216.f);
}

// FNV-1a of n bytes of device memory: variants that compute the same bytes print the same sum.
static unsigned long long sum_bytes(const void* d, size_t n) {
    std::vector<unsigned char> h(n);
    CK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
    unsigned long long s = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) s = (s ^ h[i]) * 1099511628211ull;
    return s;
}

struct BenchTimes { float median, min; };

// f run 3 times untimed, then `runs` times between events: the median and the least ms.
static BenchTimes time_ms(const std::function<void()>& f, int runs) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int it = 0; it < runs + 3; ++it) {
        CK(cudaEventRecord(e0)); f(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
        float t; CK(cudaEventElapsedTime(&t, e0, e1));
        if (it >= 3) ms.push_back(t);
    }
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    return {ms[ms.size() / 2], ms[0]};
}
