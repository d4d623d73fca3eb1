// Element-wise activations (twin of cpu/activation.rs): GELU, tanh approximation as in
// GPT-2, SwiGLU as in Llama, and the residual add. 16-byte accesses when every pointer
// allows it.

// gelu_f and gelu8: common.cuh.

// gelu_grad and dgelu8: common.cuh.

// The amax of out into *amax where it is not null (an FP8 amax sink).
extern "C" __global__ void gelu_fwd(bf16_t* out, const bf16_t* inp, unsigned* amax, long long n) {
    unsigned m = 0;
    grid_stride<8>(
        n, aligned16(out) && aligned16(inp),
        [&](long long i) {
            const uint4 y = gelu8(((const uint4*)inp)[i]);
            ((uint4*)out)[i] = y;
            m = max_abs8(y, m);
        },
        [&](long long i) {
            const bf16_t y = f2bf(gelu_f(bf2f(inp[i])));
            out[i] = y;
            m = max(m, abs_bits(y));
        });
    warp_amax_out(amax, m);
}

// d = gelu'(inp) * d, in place (each thread reads its word of d before writing it back);
// the amax of the result into *amax where it is not null (an FP8 amax sink).
extern "C" __global__ void gelu_bwd(bf16_t* d, const bf16_t* inp, unsigned* amax, long long n) {
    unsigned m = 0;
    grid_stride<8>(
        n, aligned16(d) && aligned16(inp),
        [&](long long i) {
            const uint4 y = dgelu8(((const uint4*)inp)[i], ((const uint4*)d)[i]);
            ((uint4*)d)[i] = y;
            m = max_abs8(y, m);
        },
        [&](long long i) {
            const bf16_t y = f2bf(gelu_grad(bf2f(inp[i])) * bf2f(d[i]));
            d[i] = y;
            m = max(m, abs_bits(y));
        });
    warp_amax_out(amax, m);
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

// SwiGLU over rows [gate | up] of inp[N, 2F]: out[N, F] = silu(gate) * up, silu(x) = x * sigmoid(x)
// (swiglu_f, swiglu_grads: common.cuh).

// n = N * F outputs. With F % 8 == 0 and 16-byte aligned pointers every row is whole 16-byte
// words: word i of out is row i / (F / 8), and its gate and up words sit at the same column
// of that row's two halves. The amax of out into *amax where it is not null.
extern "C" __global__ void swiglu_fwd(bf16_t* out, const bf16_t* inp, unsigned* amax, long long n, int F) {
    const int fv = F / 8;  // words per output row (vector path only)
    unsigned m = 0;
    grid_stride<8>(
        n, F % 8 == 0 && aligned16(out) && aligned16(inp),
        [&](long long i) {
            const long long r = i / fv, j = i - r * fv;
            const uint4* g = (const uint4*)inp + r * 2 * fv + j;
            float a[8], u[8];
            unpack8(g[0], a);
            unpack8(g[fv], u);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] = swiglu_f(a[k], u[k]);
            const uint4 y = pack8(a);
            ((uint4*)out)[i] = y;
            m = max_abs8(y, m);
        },
        [&](long long i) {
            const long long r = i / F, j = i - r * F;
            const bf16_t* x = inp + r * 2 * F + j;
            const float a = bf2f(x[0]);
            const bf16_t y = f2bf(swiglu_f(a, bf2f(x[F])));
            out[i] = y;
            m = max(m, abs_bits(y));
        });
    warp_amax_out(amax, m);
}

// dinp[N, 2F] (overwritten) from dout[N, F]: dgate = dout * up * silu'(gate) with
// silu'(g) = s (1 + g (1 - s)), s = sigmoid(g); dup = dout * silu(gate). n = N * F. The amax
// of dinp into *amax where it is not null.
extern "C" __global__ void swiglu_bwd(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout, unsigned* amax,
                                      long long n, int F) {
    const int fv = F / 8;
    unsigned m = 0;
    grid_stride<8>(
        n, F % 8 == 0 && aligned16(dinp) && aligned16(inp) && aligned16(dout),
        [&](long long i) {
            const long long r = i / fv, j = i - r * fv;
            const long long o = r * 2 * fv + j;
            const uint4* x = (const uint4*)inp + o;
            float a[8], u[8], dy[8], dg[8];
            unpack8(x[0], a);
            unpack8(x[fv], u);
            unpack8(((const uint4*)dout)[i], dy);
#pragma unroll
            for (int k = 0; k < 8; ++k) swiglu_grads(a[k], u[k], dy[k], dg[k], u[k]);
            uint4* d = (uint4*)dinp + o;
            const uint4 yg = pack8(dg), yu = pack8(u);
            d[0] = yg;
            d[fv] = yu;
            m = max_abs8(yu, max_abs8(yg, m));
        },
        [&](long long i) {
            const long long r = i / F, j = i - r * F;
            const long long o = r * 2 * F + j;
            const float a = bf2f(inp[o]), u = bf2f(inp[o + F]), dy = bf2f(dout[i]);
            float dg, du;
            swiglu_grads(a, u, dy, dg, du);
            const bf16_t yg = f2bf(dg), yu = f2bf(du);
            dinp[o] = yg;
            dinp[o + F] = yu;
            m = max(m, max(abs_bits(yg), abs_bits(yu)));
        });
    warp_amax_out(amax, m);
}
