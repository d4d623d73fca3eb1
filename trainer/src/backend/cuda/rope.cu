// Rotary position embedding (twin of cpu/attention.rs's rope_rotate), in place on the query
// and key heads of qkv rows: (H = nh + nkv heads of hs values at the start of a row of W
// values; the value heads after them are not touched). In every head the pair of
// dimensions (i, i + half), half = hs / 2, of the token at position p (below) turns by
// the angle whose cosine and sine are table[p * half + i] and table[T * half + p * half + i]
// (transformers' rotate_half convention):
//   lo' = lo cos - hi sin,  hi' = hi cos + lo sin.
// sign = -1 turns the other way (the backward, on the gradients: the rotation's transpose).
// Each pair is read and written by one thread, so in place is safe; fp32 arithmetic.
//
// With document starts (docs, not null: attention.rs's `AttnInputs::docs`), the position is
// the row's within its document, p = row % T - docs[row] (clamped to 0..p: the host checks the
// starts at upload). docs is null or not for the whole launch: a uniform branch, and without
// it the same arithmetic as before the option.
//
// One warp per row (blockDim.x = 256: 8 rows per block), so the row's position and its
// table rows are found once per warp.

__device__ __forceinline__ int rope_pos(const unsigned* docs, int row, int T) {
    const int p = row % T;
    return docs ? p - min((int)docs[row], p) : p;
}

// Vectorised (rope.rs: half % 8 == 0 and half / 8 = G divides 32, 16-byte aligned rows):
// lane l owns the 8 pairs starting at i = 8 (l % G) in heads l / G, l / G + 32 / G, ...;
// its 8 cosines and sines are loaded once per row (two float4 each; lanes of the same i
// read the same words). The heads go ROPE_UNROLL at a time: their loads all issued before
// any store, so a warp has that many 16-byte pairs per lane in flight.
#define ROPE_UNROLL 4

template <int G>
__device__ __forceinline__ void rope_v8(bf16_t* qkv, const float* table, int N, int T, int W, int H, float sign,
                                        const unsigned* docs) {
    constexpr int HALF = 8 * G, HS = 16 * G, STEP = 32 / G;  // heads a warp turns per pass
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const int p = rope_pos(docs, row, T), i = 8 * (lane % G);
    const float* cp = table + (long long)p * HALF + i;
    const float* sp = cp + (long long)T * HALF;
    float c[8], s[8];
    {
        const float4 c0 = *(const float4*)cp, c1 = *(const float4*)(cp + 4);
        const float4 s0 = *(const float4*)sp, s1 = *(const float4*)(sp + 4);
        c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w, c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
        s[0] = s0.x, s[1] = s0.y, s[2] = s0.z, s[3] = s0.w, s[4] = s1.x, s[5] = s1.y, s[6] = s1.z, s[7] = s1.w;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] *= sign;
    bf16_t* x = qkv + (long long)row * W + i;
    for (int h0 = lane / G; h0 < H; h0 += STEP * ROPE_UNROLL) {
        uint4 lo[ROPE_UNROLL], hi[ROPE_UNROLL];
#pragma unroll
        for (int u = 0; u < ROPE_UNROLL; ++u) {
            const int h = h0 + u * STEP;
            if (h < H) {
                lo[u] = *(const uint4*)(x + h * HS);
                hi[u] = *(const uint4*)(x + h * HS + HALF);
            }
        }
#pragma unroll
        for (int u = 0; u < ROPE_UNROLL; ++u) {
            const int h = h0 + u * STEP;
            if (h < H) {
                float a[8], b[8], ra[8], rb[8];
                unpack8(lo[u], a);
                unpack8(hi[u], b);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    ra[k] = a[k] * c[k] - b[k] * s[k];
                    rb[k] = b[k] * c[k] + a[k] * s[k];
                }
                *(uint4*)(x + h * HS) = pack8(ra);
                *(uint4*)(x + h * HS + HALF) = pack8(rb);
            }
        }
    }
}

// Instances by G = half / 8: head sizes 32, 64, 128, 256.
#define ROPE_V8(G)                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) rope_rotate_g##G(                                      \
        bf16_t* qkv, const float* table, int N, int T, int W, int H, float sign, const unsigned* docs) {     \
        rope_v8<G>(qkv, table, N, T, W, H, sign, docs);                                                      \
    }
ROPE_V8(2)
ROPE_V8(4)
ROPE_V8(8)
ROPE_V8(16)

// General: any even head size and alignment, one pair a lane and turn.
extern "C" __global__ void rope_rotate(bf16_t* qkv, const float* table, int N, int T, int W, int H, int half,
                                       float sign, const unsigned* docs) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const int p = rope_pos(docs, row, T);
    const float* cp = table + (long long)p * half;
    const float* sp = cp + (long long)T * half;
    bf16_t* x = qkv + (long long)row * W;
    for (int k = lane; k < H * half; k += 32) {
        const int h = k / half, i = k - h * half;
        const float c = cp[i], s = sign * sp[i];
        bf16_t* lo = x + h * 2 * half + i;
        const float a = bf2f(lo[0]), b = bf2f(lo[half]);
        lo[0] = f2bf(a * c - b * s);
        lo[half] = f2bf(b * c + a * s);
    }
}
