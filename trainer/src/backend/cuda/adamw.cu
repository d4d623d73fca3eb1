// AdamW with decoupled weight decay on the fp32 master weights (twin of cpu/adamw.rs);
// the updated weight is also rounded into the bf16 compute copy. The bias corrections
// bc1 = 1 - beta1^t, bc2 = 1 - beta2^t come from the host, computed as the CPU does.
// One launch updates up to ADAMW_SEGS segments (a unit's tensors: one launch per unit, not
// one per tensor). Segment s covers elements [start[s], start[s+1]) of the launch and sits
// at poff[s] / moff[s] / goff[s] of the params / state / gradient arrays; `params` may be
// null (no compute copy kept: ZeRO-3 rounds the master weights at gather time).
// A segment whose amax[s] is not null is part of an FP8 layer's whole weight: the largest
// |value| of the bf16 parameters it writes is max-ed into *amax[s] (the bits of |x|, as fp8.cu's
// amax pass keeps them; the launch code zeroed it), so the layer's casts need no amax pass.
// amax[s] is the second word of the layer's scale slot (fp8.cu).
// Where codes[s] is not null too (the layer's weight is cached in FP8: fp8.rs), the segment
// also writes the e4m3 codes of the bf16 values it writes, as they are laid out, at codes[s]:
// with the scale of a predicted amax, pred[s][0] (the weight's amax the last time: a step moves
// it by at most the update), since the weight's own is known only once every block is done.
// Block 0 records that scale in the slot's third word; fp8.cu's fp8_step_codes then checks
// it against the scale of the amax found, and transposes the codes where they agree (the codes of
// a cast with the weight's own amax: the same scale) or casts the weight again where not.

struct AdamWSegs {
    long long start[ADAMW_SEGS + 1];
    long long poff[ADAMW_SEGS];
    long long moff[ADAMW_SEGS];
    long long goff[ADAMW_SEGS];
    unsigned* amax[ADAMW_SEGS];
    unsigned char* codes[ADAMW_SEGS];
    const unsigned* pred[ADAMW_SEGS];
    float wd[ADAMW_SEGS];
    int n;
};

// The scale segment s's codes are written with (0 without codes).
__device__ __forceinline__ float adamw_codes_scale(const AdamWSegs& segs, int s) {
    return segs.codes[s] ? fp8_scale(segs.pred[s][0], 0) : 0.f;
}

// Block 0 records each coded segment's scale in its slot's third word (the segments of one
// weight record the same one).
__device__ __forceinline__ void adamw_codes_record(const AdamWSegs& segs) {
    if (blockIdx.x == 0 && threadIdx.x < segs.n && segs.codes[threadIdx.x])
        segs.amax[threadIdx.x][1] = __float_as_uint(adamw_codes_scale(segs, threadIdx.x));
}

// A thread's running amax `m` of segment `s` into the block's slot for it (shared memory):
// threads visit the segments in order, so each flushes once per segment it touched.
__device__ __forceinline__ void adamw_flush_amax(unsigned* block_amax, int s, unsigned& m) {
    if (m != 0) atomicMax(&block_amax[s], m);
    m = 0;
}

// The block's amaxes into the segments' words: an atomic per segment a block touched, where
// the word does not already hold as much (it only grows), so few of the grid's blocks
// contend for one address.
__device__ __forceinline__ void adamw_block_amax_out(unsigned* block_amax, const AdamWSegs& segs) {
    __syncthreads();
    if (threadIdx.x < segs.n && segs.amax[threadIdx.x] != nullptr) {
        unsigned* word = segs.amax[threadIdx.x];
        const unsigned m = block_amax[threadIdx.x];
        if (m != 0 && m > *(volatile unsigned*)word) atomicMax(word, m);
    }
}

__device__ __forceinline__ void adamw_block_amax_init(unsigned* block_amax) {
    if (threadIdx.x < ADAMW_SEGS) block_amax[threadIdx.x] = 0;
    __syncthreads();
}

// One element's update: the moments in place, the new master weight returned. Every kernel
// below uses it, and each operation is rounded on its own (the _rn intrinsics: no multiply-add
// contracted, which the compiler would otherwise do differently in each kernel's context), so
// every kernel computes the same bits, and the CPU's (cpu/adamw.rs: the same expression,
// IEEE single precision, evaluated in the same order).
__device__ __forceinline__ float adamw_update(float g, float& mi, float& vi, float w, float wd, float lr, float beta1,
                                              float beta2, float eps, float bc1, float bc2, float grad_scale) {
    g = __fmul_rn(g, grad_scale);
    mi = __fadd_rn(__fmul_rn(beta1, mi), __fmul_rn(__fsub_rn(1.f, beta1), g));
    vi = __fadd_rn(__fmul_rn(beta2, vi), __fmul_rn(__fmul_rn(__fsub_rn(1.f, beta2), g), g));
    const float mhat = __fdiv_rn(mi, bc1);
    const float vhat = __fdiv_rn(vi, bc2);
    const float step = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), eps)), __fmul_rn(wd, w));
    return __fsub_rn(w, __fmul_rn(lr, step));
}

extern "C" __global__ void adamw(bf16_t* params, float* master, float* m, float* v, const float* grads,
                                 const AdamWSegs segs, float lr, float beta1, float beta2, float eps,
                                 float bc1, float bc2, float grad_scale) {
    __shared__ unsigned block_amax[ADAMW_SEGS];
    adamw_block_amax_init(block_amax);
    adamw_codes_record(segs);
    const long long total = segs.start[segs.n];
    int s = 0;
    unsigned am = 0;
    float sc = adamw_codes_scale(segs, 0);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        // A thread's elements only grow, and so does its segment.
        if (i >= segs.start[s + 1]) {
            adamw_flush_amax(block_amax, s, am);
            while (i >= segs.start[s + 1]) s++;
            sc = adamw_codes_scale(segs, s);
        }
        const long long k = i - segs.start[s];
        const long long j = segs.moff[s] + k;
        float mi = m[j], vi = v[j];
        const float w = adamw_update(grads[segs.goff[s] + k], mi, vi, master[j], segs.wd[s], lr, beta1, beta2, eps,
                                     bc1, bc2, grad_scale);
        m[j] = mi;
        v[j] = vi;
        master[j] = w;
        if (params) {
            const bf16_t p = f2bf(w);
            params[segs.poff[s] + k] = p;
            if (segs.amax[s]) am = max(am, abs_bits(p));
            if (segs.codes[s]) segs.codes[s][k] = (unsigned char)(cvt2(bf2f(p) * sc, 0.f, 0) & 0xffu);
        }
    }
    adamw_flush_amax(block_amax, s, am);
    adamw_block_amax_out(block_amax, segs);
}

// The same update four elements at a time with 16-byte loads and stores (the step is bound
// by memory: 30 bytes an element, 31 with codes). adamw.rs launches it when every segment's length and
// offsets are multiples of 4 and the arrays are aligned for it.
extern "C" __global__ void adamw4(bf16_t* params, float* master, float* m, float* v, const float* grads,
                                  const AdamWSegs segs, float lr, float beta1, float beta2, float eps,
                                  float bc1, float bc2, float grad_scale) {
    __shared__ unsigned block_amax[ADAMW_SEGS];
    adamw_block_amax_init(block_amax);
    adamw_codes_record(segs);
    const long long total = segs.start[segs.n];
    int s = 0;
    unsigned am = 0;
    float sc = adamw_codes_scale(segs, 0);
    for (long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < total;
         i += 4LL * gridDim.x * blockDim.x) {
        if (i >= segs.start[s + 1]) {
            adamw_flush_amax(block_amax, s, am);
            while (i >= segs.start[s + 1]) s++;
            sc = adamw_codes_scale(segs, s);
        }
        const long long k = i - segs.start[s];
        const long long j = segs.moff[s] + k;
        const float4 g = *(const float4*)(grads + segs.goff[s] + k);
        float4 mi = *(const float4*)(m + j), vi = *(const float4*)(v + j), w = *(const float4*)(master + j);
        const float wd = segs.wd[s];
        w.x = adamw_update(g.x, mi.x, vi.x, w.x, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        w.y = adamw_update(g.y, mi.y, vi.y, w.y, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        w.z = adamw_update(g.z, mi.z, vi.z, w.z, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        w.w = adamw_update(g.w, mi.w, vi.w, w.w, wd, lr, beta1, beta2, eps, bc1, bc2, grad_scale);
        *(float4*)(m + j) = mi;
        *(float4*)(v + j) = vi;
        *(float4*)(master + j) = w;
        if (params) {
            const uint2 pb = {(unsigned)f2bf(w.x) | ((unsigned)f2bf(w.y) << 16),
                              (unsigned)f2bf(w.z) | ((unsigned)f2bf(w.w) << 16)};
            *(uint2*)(params + segs.poff[s] + k) = pb;
            if (segs.amax[s]) am = max_abs_bits2(pb.x, max_abs_bits2(pb.y, am));
            if (segs.codes[s]) {
                const unsigned c0 = cvt2(bf2f(pb.x & 0xffffu) * sc, bf2f(pb.x >> 16) * sc, 0);
                const unsigned c1 = cvt2(bf2f(pb.y & 0xffffu) * sc, bf2f(pb.y >> 16) * sc, 0);
                *(unsigned*)(segs.codes[s] + k) = c0 | (c1 << 16);
            }
        }
    }
    adamw_flush_amax(block_amax, s, am);
    adamw_block_amax_out(block_amax, segs);
}
