// Bias gradient of the linear layer (the GEMMs themselves are cuBLASLt, see matmul.rs).
// Deterministic column sums: block (x, y) sums rows [y*rows_per_chunk, ...) of 64
// columns into partial[y, col]; reduce_partials (reduce.cu) adds the chunks in order.

// blockDim = (64, 4).
extern "C" __global__ void bias_grad_partial(float* partial, const bf16_t* dout, int N, int OC,
                                             int rows_per_chunk) {
    __shared__ float red[4][64];
    const int col = blockIdx.x * 64 + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_chunk;
    const int r1 = min(N, r0 + rows_per_chunk);
    float acc = 0.f;
    if (col < OC)
        for (int r = r0 + threadIdx.y; r < r1; r += 4) acc += bf2f(dout[(long long)r * OC + col]);
    red[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < OC)
        partial[(long long)blockIdx.y * OC + col] =
            ((red[0][threadIdx.x] + red[1][threadIdx.x]) + red[2][threadIdx.x]) + red[3][threadIdx.x];
}

// dst[r, 0..cols) = src[r, 0..cols) and dst[r, cols..zero_to) = 0, for rows
// r < gridDim.y, each side with its own leading dimension: stages a GEMM operand with
// an odd dimension (the GPT-2 vocabulary, 50257) into a zero-padded one whose size is a
// multiple of 64, so cuBLASLt can use its fast kernels. Thread = 8 consecutive
// elements; a side is moved as one 16-byte word where its rows allow it.
extern "C" __global__ void copy_rows_bf16(bf16_t* dst, long long dst_ld, const bf16_t* src, long long src_ld,
                                          int cols, int zero_to) {
    const long long r = blockIdx.y;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (c0 >= zero_to) return;
    bf16_t* d = dst + r * dst_ld + c0;
    const bf16_t* s = src + r * src_ld + c0;
    if (c0 + 8 <= cols) {
        uint4 v;
        if (aligned16(s)) {
            v = *(const uint4*)s;
        } else {
            unsigned short t[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) t[k] = s[k];
            v = make_uint4(t[0] | ((unsigned)t[1] << 16), t[2] | ((unsigned)t[3] << 16), t[4] | ((unsigned)t[5] << 16),
                           t[6] | ((unsigned)t[7] << 16));
        }
        if (aligned16(d)) {
            *(uint4*)d = v;
        } else {
            const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                d[2 * k] = (bf16_t)(w[k] & 0xffffu);
                d[2 * k + 1] = (bf16_t)(w[k] >> 16);
            }
        }
    } else {
        for (int k = 0; k < 8 && c0 + k < zero_to; ++k) d[k] = c0 + k < cols ? s[k] : (bf16_t)0;
    }
}
