// The FP8 operands of the linear layers' GEMMs (train.precision = "fp8"; launch code in
// fp8.rs, the arithmetic's definition and CPU twin in backend/fp8.rs): per-tensor amax, the
// power-of-two scale, and the casts cuBLASLt's FP8 GEMMs read, row-major and transposed
// (Hopper's FP8 GEMMs want both operands with the inner dimension contiguous).
//
// A scale slot is four words: the inverse scale the GEMM applies, which the cast writes (the
// first: 16-byte aligned, as cuBLASLt's scale pointers are kept), the amax as the bits of |x|
// (zeroed by the launch code before fp8_amax_bf16 adds to it), and the scale a predicted cast
// used (see FP8_SCALE_PREDICTED; the fourth is unused).

// abs_bits, max_abs_bits2, max_abs8 (|x| as ordered bits), fp8_scale, cvt2, cvt8 and the
// transposing tile (FP8_TILE_*, fp8_tile_words, fp8_tile_store_t): common.cuh.

// amax[0] = max(amax[0], max |x|) over n bf16. Any grid; blockDim a multiple of 32.
extern "C" __global__ void fp8_amax_bf16(unsigned* amax, const bf16_t* x, long long n) {
    unsigned m = 0;
    grid_stride_reads<8, 4>(
        n, aligned16(x),
        [&](long long i) {
            m = max_abs8(((const uint4*)x)[i], m);
        },
        [&](long long i) { m = max(m, abs_bits(x[i])); });
    __shared__ unsigned sh[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 0) sh[w] = m;
    __syncthreads();
    if (w == 0) {
        m = __reduce_max_sync(0xffffffffu, lane < nw ? sh[lane] : 0u);
        if (lane == 0 && m != 0) atomicMax(amax, m);
    }
}

// 8 bf16 from `p`, one 16-byte load when `aligned`.
__device__ __forceinline__ uint4 load8(const bf16_t* p, bool aligned) {
    if (aligned) return *(const uint4*)p;
    unsigned short t[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) t[k] = p[k];
    return make_uint4(t[0] | ((unsigned)t[1] << 16), t[2] | ((unsigned)t[3] << 16), t[4] | ((unsigned)t[5] << 16),
                      t[6] | ((unsigned)t[7] << 16));
}

// The slot's inverse scale, written once per cast by the first thread (1/2^e is exact).
__device__ __forceinline__ float slot_scale(unsigned* slot, int e5m2) {
    const float s = fp8_scale(slot[1], e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) ((float*)slot)[0] = 1.f / s;
    return s;
}

// q[i] = fp8(x[i]·s), s the slot's scale, over n values (row-major: the layout is kept).
extern "C" __global__ void fp8_cast_bf16(unsigned char* q, const bf16_t* x, long long n, unsigned* slot, int e5m2) {
    const float s = slot_scale(slot, e5m2);
    grid_stride<8>(
        n, aligned16(x) && (((u64)q) & 7) == 0,
        [&](long long i) { ((uint2*)q)[i] = cvt8(((const uint4*)x)[i], s, e5m2); },
        [&](long long i) { q[i] = (unsigned char)(cvt2(bf2f(x[i]) * s, 0.f, e5m2) & 0xffu); });
}

// How a transposing cast finds its scale (`mode`):
// - FP8_SCALE_OF_AMAX: from the amax in the slot (found before the cast).
// - FP8_SCALE_PREDICTED: from a predicted amax, no amax known yet: the tensor's amax the last
//   time (pred[0], written by FP8_SCALE_CHECK), or where `ref` is set (the amax of a tensor
//   of this step that this one's scales with, e.g. the gradient the layer above received),
//   that times how ref moved since (pred[3]: ref's amax the last time). The cast also maxes
//   the amax of the values it casts into the slot (zeroed by the launch code) and records
//   the scale it used in the slot's third word.
// - FP8_SCALE_CHECK, after it: the scale of the amax now in the slot. Where it is the scale
//   used, what the predicted cast wrote stands (the same codes a cast of the amax would write:
//   the same scale) and nothing is cast; otherwise the whole cast again with it. Either way
//   block 0 writes the inverse scale, the next prediction (pred[0], pred[3]) and one count:
//   pred[1] right, pred[2] wrong.
// So a producer whose tensor's scale changes seldom needs no amax pass before its cast (and
// the cast can make what it casts, which is never written in bf16), at the cost of a cast
// again when the power-of-two scale moves.
#define FP8_SCALE_OF_AMAX 0
#define FP8_SCALE_PREDICTED 1
#define FP8_SCALE_CHECK 2

#define FP8_OP_NONE 0
#define FP8_OP_GELU 1
#define FP8_OP_DGELU 2

// x [rows, cols] bf16 → qt [cols, rows] FP8 (its transpose), and q [rows, cols] too unless q
// is null, scaled by the slot's scale (found as `mode` says). rows and cols are multiples of
// 16 (fp8::eligible); q and qt are 16-byte aligned. Any 1-D grid: block b takes tiles
// b, b + gridDim.x, ... of the (ceil(cols/64) × ceil(rows/128)) tiles in row-major order
// (with `reverse`, counted from the last); 256 threads.
// What is cast, from what is read (each rounded to bf16 as the op named writes it), by `op`:
// - FP8_OP_GELU: x is a pre-activation and the values cast are GELU(x) (gelu_fwd's): the MLP's
//   output layer's input, never written;
// - FP8_OP_DGELU: x is the gradient of GELU's output and the values cast are GELU'(aux)·x,
//   aux the pre-activation (gelu_bwd's): the MLP's input layer's output gradient, never
//   written;
// - with ln_rstd set (op FP8_OP_NONE), x is a norm's input and the values cast are its
//   output: a LayerNorm's (ln_mean and ln_b set), (x - mean[row])·rstd[row]·w[col] + b[col]
//   as layernorm_fwd computes it, or an RMSNorm's (ln_mean null), x·rstd[row]·w[col] as
//   rmsnorm_fwd computes it: a norm's output, never written.
// (The same expressions as those ops', so the same bits; the slot holds their amax, or the
// predicted cast finds it.)
// Unless colsum is null, also the column sums of the values cast per tile, colsum[tile row,
// col] (f32, [ceil(rows/128), cols]): the bias gradient of an output gradient without another
// pass over it (reduce_partials adds the tiles in order). A tile's sum, in this order: each
// 4-row group's ((x0 + x1) + x2) + x3, then the 32 groups from 0 up (0 for groups past the
// rows).
//
// Each thread loads a 4-row × 8-column patch (four 16-byte loads in flight: bandwidth needs
// bytes in flight), casts it, writes q's rows from registers, and turns its 4×8 codes into
// 8 words of 4 rows each with byte permutes, so shared memory moves words, not bytes. The
// stores then write 16 consecutive rows of one of qt's rows per 16-byte word. The +1 word of
// padding per column keeps the word writes to 2-way bank conflicts and the reads to none.
extern "C" __global__ void __launch_bounds__(256)
    fp8_cast_transpose_bf16(unsigned char* __restrict__ q, unsigned char* __restrict__ qt,
                            const bf16_t* __restrict__ x, int rows, int cols, unsigned* slot, int e5m2,
                            float* __restrict__ colsum, int op, const float* __restrict__ ln_mean,
                            const float* __restrict__ ln_rstd, const bf16_t* __restrict__ ln_w,
                            const bf16_t* __restrict__ ln_b, const bf16_t* __restrict__ aux, int mode,
                            unsigned* pred, const unsigned* ref, int reverse) {
    __shared__ Fp8TileWords t;
    __shared__ float sums[FP8_TILE_C][FP8_TILE_R / 4 + 1];  // sums[c][g]: column c over rows 4g..4g+3
    __shared__ unsigned warp_max[8];
    float s;
    if (mode == FP8_SCALE_CHECK) {
        s = fp8_scale(slot[1], e5m2);
        const bool right = __float_as_uint(s) == slot[2];
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            ((float*)slot)[0] = 1.f / s;
            pred[0] = slot[1];
            pred[3] = ref ? *ref : 0u;
            pred[right ? 1 : 2] += 1u;
        }
        if (right) return;
    } else if (mode == FP8_SCALE_PREDICTED) {
        float a = __uint_as_float(pred[0]);
        const float r = __uint_as_float(pred[3]);
        if (ref && r > 0.f) a = a * (__uint_as_float(*ref) / r);
        s = fp8_scale(__float_as_uint(a) & 0x7fffffffu, e5m2);
        if (blockIdx.x == 0 && threadIdx.x == 0) slot[2] = __float_as_uint(s);
    } else {
        s = slot_scale(slot, e5m2);
    }
    const bool aligned = aligned16(x), aux_aligned = aligned16(aux);
    const long long ld = cols;
    const int tiles_c = (cols + FP8_TILE_C - 1) / FP8_TILE_C;
    const long long tiles = (long long)tiles_c * ((rows + FP8_TILE_R - 1) / FP8_TILE_R);
    // The 8 threads of a row group read its rows' 128 contiguous bytes; rows % 16 == 0 and
    // cols % 16 == 0 put a group's rows and a thread's columns all in or all out.
    const int cg = threadIdx.x & 7, g = threadIdx.x >> 3;
    unsigned m = 0;  // FP8_SCALE_PREDICTED: the amax of this thread's values
    for (long long it = blockIdx.x; it < tiles; it += gridDim.x) {
        // With `reverse` the blocks take the tiles from the last: what the kernel before just
        // wrote last (the rows a GEMM's or attention's last blocks wrote) is then read while
        // it is still in L2 (fp8.rs: `fp8_cast_colsum`).
        const long long tile = reverse ? tiles - 1 - it : it;
        const int tr = (int)(tile / tiles_c), r0 = tr * FP8_TILE_R, c0 = (int)(tile % tiles_c) * FP8_TILE_C;
        const int gr = r0 + 4 * g, gc = c0 + 8 * cg;
        if (gr < rows && gc < cols) {
            const long long at = (long long)gr * cols + gc, xat = (long long)gr * ld + gc;
            uint4 v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = load8(x + xat + (long long)i * ld, aligned);
            if (op == FP8_OP_GELU) {
#pragma unroll
                for (int i = 0; i < 4; ++i) v[i] = gelu8(v[i]);
            } else if (op == FP8_OP_DGELU) {
#pragma unroll
                for (int i = 0; i < 4; ++i) v[i] = dgelu8(load8(aux + at + (long long)i * cols, aux_aligned), v[i]);
            }
            if (ln_rstd) {
                float ww[8], bb[8];
                unpack8(load8(ln_w + gc, aligned16(ln_w)), ww);
                if (ln_mean) unpack8(load8(ln_b + gc, aligned16(ln_b)), bb);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float r = ln_rstd[gr + i];
                    float f[8];
                    unpack8(v[i], f);
                    if (ln_mean) {
                        const float mu = ln_mean[gr + i];
#pragma unroll
                        for (int k = 0; k < 8; ++k) f[k] = (f[k] - mu) * r * ww[k] + bb[k];
                    } else {
#pragma unroll
                        for (int k = 0; k < 8; ++k) f[k] = f[k] * r * ww[k];
                    }
                    v[i] = pack8(f);
                }
            }
            if (mode == FP8_SCALE_PREDICTED) {
#pragma unroll
                for (int i = 0; i < 4; ++i) m = max_abs8(v[i], m);
            }
            if (colsum) {
                float f[4][8];
#pragma unroll
                for (int i = 0; i < 4; ++i) unpack8(v[i], f[i]);
#pragma unroll
                for (int j = 0; j < 8; ++j) sums[8 * cg + j][g] = ((f[0][j] + f[1][j]) + f[2][j]) + f[3][j];
            }
            uint2 b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) b[i] = cvt8(v[i], s, e5m2);
            if (q) {
#pragma unroll
                for (int i = 0; i < 4; ++i) *(uint2*)(q + at + (long long)i * cols) = b[i];
            }
            fp8_tile_words(t, b, cg, g);
        } else if (colsum && gc < cols) {
#pragma unroll
            for (int j = 0; j < 8; ++j) sums[8 * cg + j][g] = 0.f;
        }
        __syncthreads();
        fp8_tile_store_t(qt, t, r0, c0, rows, cols);
        if (colsum && threadIdx.x < FP8_TILE_C && c0 + (int)threadIdx.x < cols) {
            float acc = 0.f;
#pragma unroll 8
            for (int k = 0; k < FP8_TILE_R / 4; ++k) acc += sums[threadIdx.x][k];
            colsum[(long long)tr * cols + c0 + threadIdx.x] = acc;
        }
        __syncthreads();  // the next tile writes t and sums
    }
    if (mode == FP8_SCALE_PREDICTED) {
        m = __reduce_max_sync(0xffffffffu, m);
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
        __syncthreads();
        if (threadIdx.x < 32) {
            m = __reduce_max_sync(0xffffffffu, threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u);
            if (threadIdx.x == 0 && m != 0 && m > *(volatile unsigned*)(slot + 1)) atomicMax(slot + 1, m);
        }
    }
}

// ---- The cached weights whose codes the optimizer step wrote (adamw.cu; fp8.rs:
// `fp8_step_codes_check`), up to FP8_STEP_WEIGHTS of them a launch (a block's). For each: the
// scale of the amax the step found in its slot (slot[1]) against the one its codes were
// written with (slot[2]). Where they agree, qt is made from q (the transposed codes: the same
// a cast with that amax writes); otherwise x (the bf16 weight the step wrote) is cast again
// into both. The block that takes a weight's first tile writes its inverse scale, its next
// prediction and one count (pred[1] right, pred[2] wrong), as FP8_SCALE_CHECK does.
// Tiles of 256 rows × 64 columns, thread (g = tid / 4, c4 = tid % 4) taking rows 4g..4g+3 and
// columns 16·c4.. 16·c4+15: one 16-byte load of codes a row (a byte an element moves each way,
// so the loads are made wide); rows and cols are multiples of 16.
struct Fp8StepCodes {
    long long tile_start[FP8_STEP_WEIGHTS + 1];
    unsigned char* q[FP8_STEP_WEIGHTS];
    unsigned char* qt[FP8_STEP_WEIGHTS];
    const bf16_t* x[FP8_STEP_WEIGHTS];
    unsigned* slot[FP8_STEP_WEIGHTS];
    unsigned* pred[FP8_STEP_WEIGHTS];
    int rows[FP8_STEP_WEIGHTS];
    int cols[FP8_STEP_WEIGHTS];
    int n;
};

#define FP8_SC_TILE_R 256

extern "C" __global__ void __launch_bounds__(256) fp8_step_codes(const Fp8StepCodes t) {
    __shared__ unsigned words[FP8_TILE_C][FP8_SC_TILE_R / 4 + 1];  // words[c][g]: column c's codes, rows 4g..4g+3
    const int c4 = threadIdx.x & 3, g = threadIdx.x >> 2;
    int w = 0;
    for (long long tile = blockIdx.x; tile < t.tile_start[t.n]; tile += gridDim.x) {
        while (tile >= t.tile_start[w + 1]) ++w;
        const int rows = t.rows[w], cols = t.cols[w];
        unsigned* slot = t.slot[w];
        const float s = fp8_scale(slot[1], 0);
        const bool right = __float_as_uint(s) == slot[2];
        const long long k = tile - t.tile_start[w];
        if (k == 0 && threadIdx.x == 0) {
            ((float*)slot)[0] = 1.f / s;
            t.pred[w][0] = slot[1];
            t.pred[w][3] = 0u;
            t.pred[w][right ? 1 : 2] += 1u;
        }
        const int tiles_c = (cols + FP8_TILE_C - 1) / FP8_TILE_C;
        const int r0 = (int)(k / tiles_c) * FP8_SC_TILE_R, c0 = (int)(k % tiles_c) * FP8_TILE_C;
        const int gr = r0 + 4 * g, gc = c0 + 16 * c4;
        if (gr < rows && gc < cols) {
            unsigned char* q = t.q[w];
            uint4 b[4];  // row i's 16 codes
            if (right) {
#pragma unroll
                for (int i = 0; i < 4; ++i) b[i] = *(const uint4*)(q + (long long)(gr + i) * cols + gc);
            } else {
                const bf16_t* x = t.x[w];
                const bool aligned = aligned16(x);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const long long at = (long long)(gr + i) * cols + gc;
                    const uint2 lo = cvt8(load8(x + at, aligned), s, 0), hi = cvt8(load8(x + at + 8, aligned), s, 0);
                    b[i] = make_uint4(lo.x, lo.y, hi.x, hi.y);
                    *(uint4*)(q + at) = b[i];
                }
            }
            // As fp8_tile_words, for 16 columns: word h of each row holds columns 4h..4h+3.
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                const unsigned w0 = h == 0 ? b[0].x : h == 1 ? b[0].y : h == 2 ? b[0].z : b[0].w;
                const unsigned w1 = h == 0 ? b[1].x : h == 1 ? b[1].y : h == 2 ? b[1].z : b[1].w;
                const unsigned w2 = h == 0 ? b[2].x : h == 1 ? b[2].y : h == 2 ? b[2].z : b[2].w;
                const unsigned w3 = h == 0 ? b[3].x : h == 1 ? b[3].y : h == 2 ? b[3].z : b[3].w;
                const unsigned lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
                const unsigned lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
                const int c = 16 * c4 + 4 * h;
                words[c + 0][g] = __byte_perm(lo01, lo23, 0x5410);
                words[c + 1][g] = __byte_perm(lo01, lo23, 0x7632);
                words[c + 2][g] = __byte_perm(hi01, hi23, 0x5410);
                words[c + 3][g] = __byte_perm(hi01, hi23, 0x7632);
            }
        }
        __syncthreads();
        // 64 of qt's rows × 16 chunks of 16 codes (256 rows), four per thread.
        unsigned char* qt = t.qt[w];
        for (int j = threadIdx.x; j < FP8_TILE_C * (FP8_SC_TILE_R / 16); j += blockDim.x) {
            const int c = j >> 4, ch = j & 15;
            const int oc = c0 + c, orow = r0 + 16 * ch;
            if (oc < cols && orow < rows)
                *(uint4*)(qt + (long long)oc * rows + orow) =
                    make_uint4(words[c][4 * ch], words[c][4 * ch + 1], words[c][4 * ch + 2], words[c][4 * ch + 3]);
        }
        __syncthreads();  // the next tile writes words
    }
}

// ---- ZeRO-3's FP8 weight gathers (backend/fp8_gather.rs: the layout and the CPU twin;
// launch code in fp8_gather.rs). A unit's elements are cut into segments: an FP8 weight
// (kind = its slot, >= 0), other parameters (-1, "plain", sent as bf16 in the piece's side)
// or padding (-2). Rank r's piece: the codes of its shard, then its plain elements. Each FP8
// weight is cast with its whole tensor's amax (amax[slot], f32, agreed by every rank).
// FP8G_SEGS comes from Rust.

struct Fp8GatherTable {
    long long start[FP8G_SEGS];
    long long end[FP8G_SEGS];
    long long plain_before[FP8G_SEGS];
    int kind[FP8G_SEGS];
    int nseg;
    int pad_;
    long long shard;
    long long piece_bytes;
    long long side_off;
};

__device__ __forceinline__ int fp8g_segment(const Fp8GatherTable& t, long long e) {
    int s = 0;
    while (s + 1 < t.nseg && e >= t.end[s]) ++s;
    return s;
}

// Plain elements of the unit before element p.
__device__ __forceinline__ long long fp8g_plain_pos(const Fp8GatherTable& t, long long p) {
    const int s = fp8g_segment(t, p);
    return t.plain_before[s] + (t.kind[s] == -1 ? min(p, t.end[s]) - t.start[s] : 0ll);
}

// The value of an e4m3 code (Fp8Format::decode).
__device__ __forceinline__ float e4m3_value(unsigned c) {
    const unsigned f = (c >> 3) & 15u, m = c & 7u;
    float v;
    if (f == 15u && m == 7u)
        v = __int_as_float(0x7fffffff);
    else if (f == 0u)
        v = (float)m * 0.001953125f;  // m · 2^-9
    else
        v = __int_as_float(((f + 120u) << 23) | (m << 20));  // (1 + m/8) · 2^(f - 7)
    return (c & 0x80u) ? -v : v;
}

// The scale of an amax held as an f32 (NaN as infinity: the scale is NaN either way).
__device__ __forceinline__ float fp8g_scale(const float* amax, int k) {
    return fp8_scale(__float_as_uint(amax[k]) & 0x7fffffffu, 0);
}

// Rank `rank`'s piece of `dst` from its shard of `full` (bf16). Grid-stride over the shard.
extern "C" __global__ void fp8_gather_pack(unsigned char* dst, const bf16_t* full, const float* amax, int rank,
                                           Fp8GatherTable t) {
    unsigned char* piece = dst + rank * t.piece_bytes;
    const long long own = rank * t.shard;
    const long long p0 = fp8g_plain_pos(t, own);
    bf16_t* side = (bf16_t*)(piece + t.side_off);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < t.shard; i += stride) {
        const long long e = own + i;
        const int s = fp8g_segment(t, e), k = t.kind[s];
        const bf16_t x = full[e];
        unsigned code = 0;
        if (k >= 0) {
            code = cvt2(bf2f(x) * fp8g_scale(amax, k), 0.f, 0) & 0xffu;
        } else if (k == -1) {
            side[t.plain_before[s] + (e - t.start[s]) - p0] = x;
        }
        piece[i] = (unsigned char)code;
    }
}

// Every piece of `src` expanded into `full` (n = shard · world bf16). Grid-stride.
extern "C" __global__ void fp8_gather_unpack(bf16_t* full, const unsigned char* src, const float* amax, long long n,
                                             Fp8GatherTable t) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += stride) {
        const long long r = e / t.shard;
        const unsigned char* piece = src + r * t.piece_bytes;
        const int s = fp8g_segment(t, e), k = t.kind[s];
        bf16_t v = 0;
        if (k >= 0) {
            v = f2bf(e4m3_value(piece[e - r * t.shard]) * (1.f / fp8g_scale(amax, k)));
        } else if (k == -1) {
            const long long j = t.plain_before[s] + (e - t.start[s]) - fp8g_plain_pos(t, r * t.shard);
            v = ((const bf16_t*)(piece + t.side_off))[j];
        }
        full[e] = v;
    }
}
