// Deterministic reductions (twin of cpu/reduce.rs).
//
// Sums that stay on the device: the gradient norm's per-unit sums of squares and the
// per-step loss sum. The host reads all of them with one download per step instead of
// waiting for the device after each.
//
// Deterministic: the host fixes the grid, each block sums its grid-stride share in f64,
// and one warp combines the per-block partials in a fixed order.

// partial[blockIdx.x] = sum over this block's share of x[i] (square != 0: x[i]^2), in f64.
extern "C" __global__ void sum_partial(double* partial, const float* x, long long n, int square) {
    __shared__ double sh[32];
    double acc = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const double v = x[i];
        acc += square ? v * v : v;
    }
    acc = block_sum_d(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One warp. s = sum of partial[0..nb) (+ the pair already in dst when accumulate != 0);
// dst[0] = (float)s, dst[1] = s - dst[0]: an f64 kept as two f32 words (F64Pair).
extern "C" __global__ void sum_finish(float* dst, const double* partial, int nb, int accumulate) {
    double acc = 0.0;
    for (int k = threadIdx.x; k < nb; k += 32) acc += partial[k];
    acc = warp_sum_d(acc);
    if (threadIdx.x == 0) {
        const double s = (accumulate ? (double)dst[0] + (double)dst[1] : 0.0) + acc;
        const float hi = (float)s;
        dst[0] = hi;
        dst[1] = (float)(s - (double)hi);
    }
}

// The ordered reduction of per-block partial column sums that keeps the column-sum
// kernels (LayerNorm and bias gradients) deterministic.
// partial is [nchunks, W]; for j < W: s = sum of column j over the chunks; j < split goes
// to dst0[j] += s, the rest to dst1[j - split] += s (= s when overwrite != 0: a fresh
// gradient, whose old contents are not read).
// A block of 32 x RP_ROWS threads owns 32 columns: thread (x, y) sums chunks y, y + RP_ROWS,
// ... of column x (a warp reads 128 contiguous bytes per chunk), then row y = 0 adds the
// RP_ROWS sums in y order. RP_ROWS (reduce.rs) is a constant, not derived from the GPU: the
// same order, and the same bits, on every GPU. (One thread per column, the earlier kernel,
// left the LayerNorm backward's thousands of partial rows to a few SMs.)
extern "C" __global__ void reduce_partials(float* dst0, float* dst1, int split, const float* partial,
                                           int nchunks, int W, int overwrite) {
    __shared__ float sh[RP_ROWS][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (j < W) {
#pragma unroll 4
        for (int k = threadIdx.y; k < nchunks; k += RP_ROWS) s += partial[(long long)k * W + j];
    }
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < W) {
        float t = 0.f;
#pragma unroll
        for (int y = 0; y < RP_ROWS; ++y) t += sh[y][threadIdx.x];
        float* d = j < split ? dst0 + j : dst1 + (j - split);
        *d = overwrite ? t : *d + t;
    }
}
