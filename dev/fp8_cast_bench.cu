// The transposing FP8 cast (fp8.cu's fp8_cast_transpose_bf16) at GPT-2 1.5B's shapes (8192
// rows), timed outside the trainer on the GPU machine's nvcc, as the trainer launches it (one
// tile a block) and at grids of 2-8 blocks an SM: the bytes it must move, its median time of 50,
// the TB/s, and a checksum of its codes that every grid of a row must share. A device-to-device
// copy gives the machine's bandwidth beside it. Built by dev/fp8-cast-variants.sh. (The
// commit that added this file also timed a variant loading each block's next tile ahead: no
// gain, BENCHMARKS.md run 26; 5b49108 timed the output gradients' bias sums added up by the
// cast itself against a reduce launch after it: slower at every shape, run 27.)
#include <string>
#include "bench_util.cuh"
#include "common.cuh"
#include "fp8.cu"

__global__ void fill_bf16(bf16_t* x, long long n, unsigned seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf((bench_unit(i, seed) - 0.5f) * 4.f);
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long big = 8192LL * 6400;
    bf16_t *x, *aux;
    unsigned char *q, *qt;
    float* colsum;
    unsigned* slot;
    CK(cudaMalloc(&x, big * 2)); CK(cudaMalloc(&aux, big * 2));
    CK(cudaMalloc(&q, big)); CK(cudaMalloc(&qt, big));
    CK(cudaMalloc(&colsum, 64 * 6400 * 4)); CK(cudaMalloc(&slot, 16));
    fill_bf16<<<1024, 256>>>(x, big, 1);
    fill_bf16<<<1024, 256>>>(aux, big, 2);
    const unsigned amax_bits = 0x40000000u;  // 2.0: |values| < 2 (GELU' may exceed it: saturates, the same for all)
    CK(cudaMemcpy(slot + 1, &amax_bits, 4, cudaMemcpyHostToDevice));
    {
        const double t = time_ms([&] { CK(cudaMemcpyAsync(aux, x, big * 2 * 2 / 5, cudaMemcpyDeviceToDevice)); }, 50).median;
        printf("copy of %.0f MB (%.0f MB moved): %.3f ms, %.2f TB/s\n", big * 2 * 2 / 5 / 1e6, 2 * big * 2 * 2 / 5 / 1e6, t,
               2 * big * 2 * 2 / 5 / (t * 1e9));
        fill_bf16<<<1024, 256>>>(aux, big, 2);
    }
    struct Row { const char* name; int rows, cols, op, e5m2; bool q, colsum; double reads; };
    // (what, rows, cols, op, e5m2, q too, column sums, bf16 arrays read)
    const Row rowsv[] = {
        {"proj/fc2 dY 8192x1600 (q, qt, colsum, e5m2)", 8192, 1600, FP8_OP_NONE, 1, true, true, 1},
        {"qkv dY 8192x4800 (q, qt, colsum, e5m2)", 8192, 4800, FP8_OP_NONE, 1, true, true, 1},
        {"input 8192x1600 (q, qt)", 8192, 1600, FP8_OP_NONE, 0, true, false, 1},
        {"GELU 8192x6400 (q, qt)", 8192, 6400, FP8_OP_GELU, 0, true, false, 1},
        {"GELU' 8192x6400 (q, qt, colsum, e5m2)", 8192, 6400, FP8_OP_DGELU, 1, true, true, 2},
        {"weight 6400x1600 (q, qt)", 6400, 1600, FP8_OP_NONE, 0, true, false, 1},
        {"weight 1600x6400 (q, qt)", 1600, 6400, FP8_OP_NONE, 0, true, false, 1},
    };
    printf("%d SMs; per row: bytes moved, then each variant's median ms, TB/s, codes checksum\n", sms);
    for (const Row& r : rowsv) {
        const long long n = (long long)r.rows * r.cols;
        const int tiles = ((r.rows + 127) / 128) * ((r.cols + 63) / 64);
        const double bytes = n * (2.0 * r.reads + 1 + (r.q ? 1 : 0)) + (r.colsum ? (r.rows / 128.0) * r.cols * 4 : 0);
        printf("%s: %.0f MB, %d tiles\n", r.name, bytes / 1e6, tiles);
        float* cs = r.colsum ? colsum : nullptr;
        auto run = [&](int grid) {
            return [=] {
                fp8_cast_transpose_bf16<<<grid, 256>>>(r.q ? q : nullptr, qt, x, r.rows, r.cols, slot, r.e5m2, cs, r.op,
                                                       nullptr, nullptr, nullptr, nullptr, aux, FP8_SCALE_OF_AMAX,
                                                       nullptr, nullptr, 0);
            };
        };
        std::vector<std::pair<std::string, std::function<void()>>> vs;
        vs.push_back({"a tile a block", run(tiles)});
        for (int b : {2, 4, 8}) vs.push_back({std::to_string(b) + " blocks/SM", run(std::min(tiles, b * sms))});
        for (auto& [name, f] : vs) {
            CK(cudaMemset(qt, 0, n));
            const double t = time_ms(f, 50).median;
            CK(cudaDeviceSynchronize());
            printf("  %-22s %.4f ms  %.2f TB/s  qt %016llx q %016llx\n", name.c_str(), t, bytes / (t * 1e9), sum_bytes(qt, n),
                   r.q ? sum_bytes(q, n) : 0ull);
        }
    }
    return 0;
}
