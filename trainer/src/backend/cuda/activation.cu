// Element-wise activations (twin of cpu/activation.rs): GELU, tanh approximation as in
// GPT-2, and the residual add. 16-byte accesses when every pointer allows it.

#define GELU_K 0.7978845608f  // sqrt(2/pi)

__device__ __forceinline__ float gelu_f(float x) {
    const float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.f + tanhf(GELU_K * (x + cube)));
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float cube = 0.044715f * x * x * x;
    const float th = tanhf(GELU_K * (x + cube));
    const float sech2 = 1.f - th * th;
    return 0.5f * (1.f + th) + x * 0.5f * sech2 * GELU_K * (1.f + 3.f * 0.044715f * x * x);
}

extern "C" __global__ void gelu_fwd(bf16_t* out, const bf16_t* inp, long long n) {
    grid_stride<8>(
        n, aligned16(out) && aligned16(inp),
        [&](long long i) {
            float x[8];
            unpack8(((const uint4*)inp)[i], x);
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] = gelu_f(x[k]);
            ((uint4*)out)[i] = pack8(x);
        },
        [&](long long i) { out[i] = f2bf(gelu_f(bf2f(inp[i]))); });
}

// dinp = gelu'(inp) * dout (overwrite).
extern "C" __global__ void gelu_bwd(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout, long long n) {
    grid_stride<8>(
        n, aligned16(dinp) && aligned16(inp) && aligned16(dout),
        [&](long long i) {
            float x[8], g[8];
            unpack8(((const uint4*)inp)[i], x);
            unpack8(((const uint4*)dout)[i], g);
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] = gelu_grad(x[k]) * g[k];
            ((uint4*)dinp)[i] = pack8(x);
        },
        [&](long long i) { dinp[i] = f2bf(gelu_grad(bf2f(inp[i])) * bf2f(dout[i])); });
}

// Residual connection out = a + b.
extern "C" __global__ void residual_fwd(bf16_t* out, const bf16_t* a, const bf16_t* b, long long n) {
    grid_stride<8>(
        n, aligned16(out) && aligned16(a) && aligned16(b),
        [&](long long i) {
            float x[8], y[8];
            unpack8(((const uint4*)a)[i], x);
            unpack8(((const uint4*)b)[i], y);
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] += y[k];
            ((uint4*)out)[i] = pack8(x);
        },
        [&](long long i) { out[i] = f2bf(bf2f(a[i]) + bf2f(b[i])); });
}
