// Token (+ position) embedding (twin of cpu/encoder.rs), positions optionally within
// documents.
//
// The backward is deterministic: no atomics. The host groups the rows by token
// (stable, so positions stay in order) and one thread block per distinct token sums
// its rows in that order; the position table is summed over the batch in order.

// out[N,C] = wte[tok] (+ wpe[t] when wpe is not null); a token outside the table gives NaN
// (visible in the loss). t is the row's position in its sequence, or with docs (not null:
// each row's document start, checked at upload) in its document.
extern "C" __global__ void encoder_fwd(bf16_t* out, const unsigned* tokens, const unsigned* docs,
                                       const bf16_t* wte, const bf16_t* wpe, int N, int T, int C,
                                       unsigned V) {
    const bool pos = wpe != nullptr;
    const bool vec = (C % 8 == 0) && aligned16(out) && aligned16(wte) && (!pos || aligned16(wpe));
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (vec) {
        const int cv = C / 8;
        const long long total = (long long)N * cv;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += stride) {
            const int row = (int)(i / cv), c8 = (int)(i % cv) * 8;
            const unsigned tok = tokens[row];
            const int t = row % T - (docs != nullptr ? (int)docs[row] : 0);
            float o[8];
            if (tok < V) {
                float e[8], p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                unpack8(*(const uint4*)(wte + (long long)tok * C + c8), e);
                if (pos) unpack8(*(const uint4*)(wpe + (long long)t * C + c8), p);
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = e[k] + p[k];
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = __int_as_float(0x7fc00000);
            }
            *(uint4*)(out + (long long)row * C + c8) = pack8(o);
        }
    } else {
        const long long total = (long long)N * C;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += stride) {
            const int row = (int)(i / C), c = (int)(i % C);
            const unsigned tok = tokens[row];
            const int t = row % T - (docs != nullptr ? (int)docs[row] : 0);
            float o = tok < V ? bf2f(wte[(long long)tok * C + c]) + (pos ? bf2f(wpe[(long long)t * C + c]) : 0.f)
                              : __int_as_float(0x7fc00000);
            out[i] = f2bf(o);
        }
    }
}

// dwpe[t,c] += sum over b (in order) of dout[b,t,c]. (Positions within documents sum their
// rows with encoder_bwd_wte over the document starts' plan, grouped by position.)
extern "C" __global__ void encoder_bwd_wpe(float* dwpe, const bf16_t* dout, int B, int T, int C) {
    const long long total = (long long)T * C;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float acc = 0.f;
        for (int b = 0; b < B; ++b) acc += bf2f(dout[(long long)b * total + i]);
        dwpe[i] += acc;
    }
}

// plan = [nb | starts (nb+1) | tokens (nb) | rows (N)]: bucket k holds rows
// rows[starts[k]..starts[k+1]] (ascending), all with token tokens[k].
// grid = (N, ceil(C / blockDim.x)), blocks past nb idle; dwte[tok,c] += sum over the bucket's rows.
extern "C" __global__ void encoder_bwd_wte(float* dwte, const bf16_t* dout, const unsigned* plan, int C) {
    const int nb = (int)plan[0];  // distinct ids; the grid has a block for every row
    const int k = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (k >= nb || c >= C) return;
    const unsigned* starts = plan + 1;
    const unsigned* toks = plan + nb + 2;
    const unsigned* rows = plan + 2 * nb + 2;
    float acc = 0.f;
    for (unsigned p = starts[k]; p < starts[k + 1]; ++p) acc += bf2f(dout[(long long)rows[p] * C + c]);
    dwte[(long long)toks[k] * C + c] += acc;
}
