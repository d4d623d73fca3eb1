// Bias gradient of the linear layer (the GEMMs themselves are cuBLASLt, see matmul.rs).
// Deterministic column sums: block (x, y) sums rows [y*rows_per_chunk, ...) of 64
// columns into partial[y, col]; reduce_partials (cast.cu) adds the chunks in order.

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
