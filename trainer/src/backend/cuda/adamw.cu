// AdamW with decoupled weight decay on the fp32 master weights (twin of cpu/adamw.rs);
// the updated weight is also rounded into the bf16 compute copy. The bias corrections
// bc1 = 1 - beta1^t, bc2 = 1 - beta2^t come from the host, computed as the CPU does.
// One launch updates up to ADAMW_SEGS segments (a unit's tensors: one launch per unit, not
// one per tensor). Segment s covers elements [start[s], start[s+1]) of the launch and sits
// at poff[s] / moff[s] / goff[s] of the params / state / gradient arrays; `params` may be
// null (no compute copy kept: ZeRO-3 rounds the master weights at gather time).
// A segment whose amax[s] is not null is an FP8 layer's whole weight: the largest |value| of
// the bf16 parameters it writes is max-ed into *amax[s] (the bits of |x|, as fp8.cu's amax
// pass keeps them; the launch code zeroed it), so the layer's casts need no amax pass.

struct AdamWSegs {
    long long start[ADAMW_SEGS + 1];
    long long poff[ADAMW_SEGS];
    long long moff[ADAMW_SEGS];
    long long goff[ADAMW_SEGS];
    unsigned* amax[ADAMW_SEGS];
    float wd[ADAMW_SEGS];
    int n;
};

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
    const long long total = segs.start[segs.n];
    int s = 0;
    unsigned am = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        // A thread's elements only grow, and so does its segment.
        if (i >= segs.start[s + 1]) {
            adamw_flush_amax(block_amax, s, am);
            while (i >= segs.start[s + 1]) s++;
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
        }
    }
    adamw_flush_amax(block_amax, s, am);
    adamw_block_amax_out(block_amax, segs);
}

// The same update four elements at a time with 16-byte loads and stores (the step is bound
// by memory: 30 bytes an element). adamw.rs launches it when every segment's length and
// offsets are multiples of 4 and the arrays are aligned for it.
extern "C" __global__ void adamw4(bf16_t* params, float* master, float* m, float* v, const float* grads,
                                  const AdamWSegs segs, float lr, float beta1, float beta2, float eps,
                                  float bc1, float bc2, float grad_scale) {
    __shared__ unsigned block_amax[ADAMW_SEGS];
    adamw_block_amax_init(block_amax);
    const long long total = segs.start[segs.n];
    int s = 0;
    unsigned am = 0;
    for (long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < total;
         i += 4LL * gridDim.x * blockDim.x) {
        if (i >= segs.start[s + 1]) {
            adamw_flush_amax(block_amax, s, am);
            while (i >= segs.start[s + 1]) s++;
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
        }
    }
    adamw_flush_amax(block_amax, s, am);
    adamw_block_amax_out(block_amax, segs);
}

// ---- The step writing FP8 layers' cached weights (adamw.rs; fp8.rs: "step codes") ----
// An FP8 layer whose weight is cached (both layouts of e4m3 codes, fp8.rs) and written whole
// by this step gets its update here, by tiles of the weight [rows, cols] (fp8.cu's
// transposing tile: 128 rows × 64 columns, 256 threads of 4 rows × 8 columns), which also
// writes the bf16 values' codes as they are and transposed: the weight's cast after the step
// (a pass reading the bf16 weight and writing both layouts) is not needed. The codes need the
// scale before the amax of what they encode is known, so the update casts with the scale of
// a predicted amax (the weight's last one, pred[0]: it moves by at most the update's size in
// a step), maxes the true amax into the slot (zeroed by the launch code) and records the
// scale it used in slot[2]. A check launch after it (ADAMW_FP8_CHECK) computes the scale of
// the true amax; where it is the one used the codes stand (those of the cast with the
// weight's own amax: the same scale), otherwise it casts the weight again from the bf16
// values the update wrote. Either way block 0 writes the inverse scale the GEMMs read, the
// next prediction and one count (pred[1] right, pred[2] wrong). So the codes are current
// scaling's, bit for bit, whatever the prediction.
#define ADAMW_FP8_UPDATE 0
#define ADAMW_FP8_CHECK 1

// Up to ADAMW_FP8_WEIGHTS weights; weight w's tiles are [tile_start[w], tile_start[w + 1])
// of the launch (row-major over its tiles), its elements at poff/moff/goff of the params,
// state and gradient arrays (rows·cols of them, offsets allowing 16-byte accesses).
struct AdamWFp8 {
    long long tile_start[ADAMW_FP8_WEIGHTS + 1];
    long long poff[ADAMW_FP8_WEIGHTS];
    long long moff[ADAMW_FP8_WEIGHTS];
    long long goff[ADAMW_FP8_WEIGHTS];
    unsigned char* q[ADAMW_FP8_WEIGHTS];
    unsigned char* qt[ADAMW_FP8_WEIGHTS];
    unsigned* slot[ADAMW_FP8_WEIGHTS];
    unsigned* pred[ADAMW_FP8_WEIGHTS];
    int rows[ADAMW_FP8_WEIGHTS];
    int cols[ADAMW_FP8_WEIGHTS];
    float wd[ADAMW_FP8_WEIGHTS];
    int n;
};

// 4 consecutive fp32 values (one 16-byte access).
__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ void st4(float* p, float4 x) { *(float4*)p = x; }

// Eight elements' update from `e` of weight w (16-byte accesses), returning their bf16 values
// as written to params.
__device__ __forceinline__ uint4 adamw_fp8_update8(bf16_t* params, float* master, float* m, float* v,
                                                   const float* grads, const AdamWFp8& t, int w, long long e,
                                                   float lr, float beta1, float beta2, float eps, float bc1,
                                                   float bc2, float grad_scale) {
    const long long j = t.moff[w] + e, gj = t.goff[w] + e;
    float g[8], mi[8], vi[8], x[8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float4 g4 = ld4(grads + gj + 4 * h), m4 = ld4(m + j + 4 * h), v4 = ld4(v + j + 4 * h),
                     x4 = ld4(master + j + 4 * h);
        g[4 * h] = g4.x, g[4 * h + 1] = g4.y, g[4 * h + 2] = g4.z, g[4 * h + 3] = g4.w;
        mi[4 * h] = m4.x, mi[4 * h + 1] = m4.y, mi[4 * h + 2] = m4.z, mi[4 * h + 3] = m4.w;
        vi[4 * h] = v4.x, vi[4 * h + 1] = v4.y, vi[4 * h + 2] = v4.z, vi[4 * h + 3] = v4.w;
        x[4 * h] = x4.x, x[4 * h + 1] = x4.y, x[4 * h + 2] = x4.z, x[4 * h + 3] = x4.w;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
        x[k] = adamw_update(g[k], mi[k], vi[k], x[k], t.wd[w], lr, beta1, beta2, eps, bc1, bc2, grad_scale);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        st4(m + j + 4 * h, make_float4(mi[4 * h], mi[4 * h + 1], mi[4 * h + 2], mi[4 * h + 3]));
        st4(v + j + 4 * h, make_float4(vi[4 * h], vi[4 * h + 1], vi[4 * h + 2], vi[4 * h + 3]));
        st4(master + j + 4 * h, make_float4(x[4 * h], x[4 * h + 1], x[4 * h + 2], x[4 * h + 3]));
    }
    const uint4 p = pack8(x);
    *(uint4*)(params + t.poff[w] + e) = p;
    return p;
}

// mode ADAMW_FP8_UPDATE: every tile of every weight updated and cast with its predicted scale
// (any 1-D grid; one tile a block is the launch code's choice). ADAMW_FP8_CHECK: the weights
// whose scale was mispredicted cast again from params (a grid of a few blocks per SM, which
// return at once where every prediction held). Tiles of TC columns × TR rows (Fp8TileOf).
template <int TC, int TR>
__device__ __forceinline__ void adamw_fp8_body(bf16_t* __restrict__ params, float* __restrict__ master,
                                               float* __restrict__ m, float* __restrict__ v,
                                               const float* __restrict__ grads, const AdamWFp8& t, int mode,
                                               float lr, float beta1, float beta2, float eps, float bc1, float bc2,
                                               float grad_scale) {
    typedef Fp8TileOf<TC, TR> Tile;
    __shared__ typename Tile::Words tw;
    __shared__ float scale[ADAMW_FP8_WEIGHTS];
    __shared__ int cast[ADAMW_FP8_WEIGHTS];  // whether this launch casts weight w
    if (threadIdx.x < t.n) {
        const int w = threadIdx.x;
        unsigned* slot = t.slot[w];
        if (mode == ADAMW_FP8_UPDATE) {
            const float s = fp8_scale(t.pred[w][0], 0);
            scale[w] = s;
            cast[w] = 1;
            if (blockIdx.x == 0) slot[2] = __float_as_uint(s);
        } else {
            const float s = fp8_scale(slot[1], 0);
            const bool right = __float_as_uint(s) == slot[2];
            scale[w] = s;
            cast[w] = !right;
            if (blockIdx.x == 0) {
                ((float*)slot)[0] = 1.f / s;
                t.pred[w][0] = slot[1];
                t.pred[w][right ? 1 : 2] += 1u;
            }
        }
    }
    __syncthreads();
    const long long tiles = t.tile_start[t.n];
    const int cg = threadIdx.x % Tile::per_row, g = threadIdx.x / Tile::per_row;
    int w = 0;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        while (tile >= t.tile_start[w + 1]) ++w;
        if (!cast[w]) continue;  // the whole block alike
        const int rows = t.rows[w], cols = t.cols[w];
        const int tiles_c = (cols + TC - 1) / TC;
        const long long k = tile - t.tile_start[w];
        const int r0 = (int)(k / tiles_c) * TR, c0 = (int)(k % tiles_c) * TC;
        const int gr = r0 + 4 * g, gc = c0 + 8 * cg;
        const float s = scale[w];
        unsigned am = 0;
        if (gr < rows && gc < cols) {
            uint2 b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const long long e = (long long)(gr + i) * cols + gc;
                uint4 p;
                if (mode == ADAMW_FP8_UPDATE) {
                    p = adamw_fp8_update8(params, master, m, v, grads, t, w, e, lr, beta1, beta2, eps, bc1, bc2,
                                          grad_scale);
                    am = max_abs8(p, am);
                } else {
                    p = *(const uint4*)(params + t.poff[w] + e);
                }
                b[i] = cvt8(p, s, 0);
                *(uint2*)(t.q[w] + e) = b[i];
            }
            fp8_tile_words<TC, TR>(tw, b, cg, g);
        }
        if (mode == ADAMW_FP8_UPDATE) warp_amax_out(t.slot[w] + 1, am);
        __syncthreads();
        fp8_tile_store_t<TC, TR>(t.qt[w], tw, r0, c0, rows, cols);
        __syncthreads();  // the next tile writes tw
    }
}

extern "C" __global__ void __launch_bounds__(256)
    adamw_fp8(bf16_t* __restrict__ params, float* __restrict__ master, float* __restrict__ m, float* __restrict__ v,
              const float* __restrict__ grads, const AdamWFp8 t, int mode, float lr, float beta1, float beta2,
              float eps, float bc1, float bc2, float grad_scale) {
    adamw_fp8_body<ADAMW_FP8_TILE_C, ADAMW_FP8_TILE_R>(params, master, m, v, grads, t, mode, lr, beta1, beta2, eps,
                                                       bc1, bc2, grad_scale);
}
