// Residual connection out = a + b (the CPU twin is inline in cpu/mod.rs).

extern "C" __global__ void residual_fwd(bf16_t* out, const bf16_t* a, const bf16_t* b, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long done = 0;
    if (aligned16(out) && aligned16(a) && aligned16(b)) {
        const long long nv = n / 8;
        for (long long i = t0; i < nv; i += stride) {
            float x[8], y[8];
            unpack8(((const uint4*)a)[i], x);
            unpack8(((const uint4*)b)[i], y);
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] += y[k];
            ((uint4*)out)[i] = pack8(x);
        }
        done = nv * 8;
    }
    for (long long i = done + t0; i < n; i += stride) out[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}
