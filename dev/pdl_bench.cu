// What programmatic dependent launch (PDL) would save between the step's kernels, measured
// before any launch code uses it: chains of K dependent grid-stride kernels captured into a
// CUDA graph, launched plainly and with cudaLaunchAttributeProgrammaticStreamSerialization
// (each kernel then waits on its predecessor with griddepcontrol.wait and lets its successor
// launch with griddepcontrol.launch_dependents), at the sizes the step's small kernels have.
// Prints the time per kernel each way and the saving per boundary. Build (dev/ holds
// bench_util.cuh): nvcc -arch=sm_90 -O3 -std=c++17 pdl_bench.cu -o pdl_bench. On an H200
// (BENCHMARKS.md run 27) it saved 0.07-0.23 µs a boundary at best and lost up to 0.7 µs at
// some sizes, so the trainer does not use PDL.
#include "bench_util.cuh"

// a[i] = a[i]·k + 1 over n floats (16-byte loads), `blocks` blocks of 256 threads striding.
template <bool PDL>
__global__ void __launch_bounds__(256) chain_step(float4* a, long long n4, float k) {
    if (PDL) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n4; i += (long long)gridDim.x * 256) {
        float4 v = a[i];
        v.x = v.x * k + 1.f; v.y = v.y * k + 1.f; v.z = v.z * k + 1.f; v.w = v.w * k + 1.f;
        a[i] = v;
    }
}

static void launch(bool pdl, float4* a, long long n4, unsigned blocks, cudaStream_t st) {
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(blocks);
    c.blockDim = dim3(256);
    c.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at;
    c.numAttrs = pdl ? 1 : 0;
    const float k = 0.5f;
    if (pdl) CK(cudaLaunchKernelEx(&c, chain_step<true>, a, n4, k));
    else CK(cudaLaunchKernelEx(&c, chain_step<false>, a, n4, k));
}

int main() {
    int dev = 0, sms = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int K = 400;
    const long long max_n = 1ll << 25;
    float4* a;
    CK(cudaMalloc(&a, max_n * 4));
    CK(cudaMemset(a, 0, max_n * 4));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    printf("chains of %d dependent kernels in one CUDA graph, %d SMs\n", K, sms);
    printf("%12s %8s %12s %12s %12s\n", "floats", "blocks", "plain us/k", "PDL us/k", "saved us/k");
    // (floats, blocks): the step's grid-stride kernels take min(work/256, 16·SMs) blocks; the
    // ordered sums a few dozen.
    const long long sizes[] = {1ll << 14, 1ll << 16, 1ll << 18, 1ll << 20, 1ll << 22, 1ll << 23, 1ll << 25};
    for (long long n : sizes) {
        for (int mode = 0; mode < 2; ++mode) {
            long long n4 = n / 4;
            unsigned blocks = mode == 0 ? (unsigned)std::min<long long>((n4 + 255) / 256, 16ll * sms) : 48u;
            if (mode == 1 && n > (1ll << 20)) continue;
            float us[2];
            for (int pdl = 0; pdl < 2; ++pdl) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                for (int i = 0; i < K; ++i) launch(pdl, a, n4, blocks, st);
                CK(cudaStreamEndCapture(st, &g));
                CK(cudaGraphInstantiate(&ge, g, 0));
                cudaEvent_t e0, e1;
                CK(cudaEventCreate(&e0));
                CK(cudaEventCreate(&e1));
                std::vector<float> ms;
                for (int it = 0; it < 13; ++it) {
                    CK(cudaEventRecord(e0, st));
                    CK(cudaGraphLaunch(ge, st));
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float t;
                    CK(cudaEventElapsedTime(&t, e0, e1));
                    if (it >= 3) ms.push_back(t);
                }
                std::sort(ms.begin(), ms.end());
                us[pdl] = ms[ms.size() / 2] * 1000.f / K;
                CK(cudaGraphExecDestroy(ge));
                CK(cudaGraphDestroy(g));
                CK(cudaEventDestroy(e0));
                CK(cudaEventDestroy(e1));
            }
            printf("%12lld %8u %12.2f %12.2f %12.2f\n", n, blocks, us[0], us[1], us[0] - us[1]);
        }
    }
    printf("checksum %llx\n", sum_bytes(a, 1 << 16));
    return 0;
}
