// AdamW with decoupled weight decay on the fp32 master weights (twin of cpu/adamw.rs);
// the updated weight is also rounded into the bf16 compute copy. The bias corrections
// bc1 = 1 - beta1^t, bc2 = 1 - beta2^t come from the host, computed as the CPU does.
// Pointers arrive already offset to the segment; `params` may be null (no compute copy
// kept: ZeRO-3 rounds the master weights at gather time).

extern "C" __global__ void adamw(bf16_t* params, float* master, float* m, float* v, const float* grads,
                                 long long len, float lr, float beta1, float beta2, float eps, float wd,
                                 float bc1, float bc2, float grad_scale) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = grads[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.f - beta1) * g;
        const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float mhat = mi / bc1;
        const float vhat = vi / bc2;
        float w = master[i];
        w -= lr * (mhat / (sqrtf(vhat) + eps) + wd * w);
        master[i] = w;
        if (params) params[i] = f2bf(w);
    }
}
