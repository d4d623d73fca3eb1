// AdamW with decoupled weight decay on the fp32 master weights (twin of cpu/adamw.rs);
// the updated weight is also rounded into the bf16 compute copy. The bias corrections
// bc1 = 1 - beta1^t, bc2 = 1 - beta2^t come from the host, computed as the CPU does.
// One launch updates up to ADAMW_SEGS segments (a unit's tensors: one launch per unit, not
// one per tensor). Segment s covers elements [start[s], start[s+1]) of the launch and sits
// at poff[s] / moff[s] / goff[s] of the params / state / gradient arrays; `params` may be
// null (no compute copy kept: ZeRO-3 rounds the master weights at gather time).

struct AdamWSegs {
    long long start[ADAMW_SEGS + 1];
    long long poff[ADAMW_SEGS];
    long long moff[ADAMW_SEGS];
    long long goff[ADAMW_SEGS];
    float wd[ADAMW_SEGS];
    int n;
};

extern "C" __global__ void adamw(bf16_t* params, float* master, float* m, float* v, const float* grads,
                                 const AdamWSegs segs, float lr, float beta1, float beta2, float eps,
                                 float bc1, float bc2, float grad_scale) {
    const long long total = segs.start[segs.n];
    int s = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        // A thread's elements only grow, and so does its segment.
        while (i >= segs.start[s + 1]) s++;
        const long long k = i - segs.start[s];
        const long long j = segs.moff[s] + k;
        const float g = grads[segs.goff[s] + k] * grad_scale;
        const float mi = beta1 * m[j] + (1.f - beta1) * g;
        const float vi = beta2 * v[j] + (1.f - beta2) * g * g;
        m[j] = mi;
        v[j] = vi;
        const float mhat = mi / bc1;
        const float vhat = vi / bc2;
        float w = master[j];
        w -= lr * (mhat / (sqrtf(vhat) + eps) + segs.wd[s] * w);
        master[j] = w;
        if (params) params[segs.poff[s] + k] = f2bf(w);
    }
}
