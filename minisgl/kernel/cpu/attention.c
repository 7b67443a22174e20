// Attention for the CPU, read in place from the paged KV pool through the page table (no gather into a
// padded batch): decode (each request's one query over its context) and, further down, prefill.
//
// Plain C with OpenMP, called through ctypes: it builds in about a second with gcc and needs no
// torch headers. Decode: work is split over requests; a token's K (and V) row of every head is read once,
// contiguously, and the rows a few tokens ahead are prefetched. Rows are handled as 16-float vectors
// (GCC vector extensions, which the compiler maps to AVX-512, AVX2 or SSE); a head_dim that is not
// a multiple of 16 takes the scalar loop.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// the element types of the pool: what `kv_kind` says
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8_E4M3 = 2 };

// every float8 e4m3fn byte as a float (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities,
// S.1111.111 is NaN); an FP8 pool's scale is applied by the caller, outside the loops
static float fp8_e4m3_values[256];

__attribute__((constructor)) static void init_fp8_e4m3_values(void) {
    for (int i = 0; i < 256; ++i) {
        const int e = (i >> 3) & 15, m = i & 7;
        float f = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + (float)m / 8.f, e - 7);
        if (e == 15 && m == 7) f = NAN;
        fp8_e4m3_values[i] = i & 128 ? -f : f;
    }
}

// 16 values of a row (float32, bf16 or fp8) as floats
static inline v16f load16(const void *base, int64_t i, int kind) {
    if (kind == KV_F32) return *(const v16f *)((const float *)base + i);
    if (kind == KV_FP8_E4M3) {
        const uint8_t *p = (const uint8_t *)base + i;
        v16f f;
        for (int j = 0; j < 16; ++j) f[j] = fp8_e4m3_values[p[j]];
        return f;
    }
    v16u u = __builtin_convertvector(*(const v16h *)((const uint16_t *)base + i), v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float load1(const void *base, int64_t i, int kind) {
    if (kind == KV_F32) return ((const float *)base)[i];
    if (kind == KV_FP8_E4M3) return fp8_e4m3_values[((const uint8_t *)base)[i]];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef int32_t v16i __attribute__((vector_size(64)));

static inline float hsum(v16f x) {
    v16f y = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    y += __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    y += __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return y[0] + y[1];
}

// exp of 16 values <= 0 (scores minus their maximum): 2^n * p(r) with n the nearest integer to
// x / ln2 and |r| <= ln2/2, Cephes' degree-6 polynomial (relative error about 2e-7); x is clamped at
// -87, where exp is below float's normal range anyway.
static inline v16f exp16(v16f x) {
    const v16f floor_ = (v16f){0} - 87.f;
    const v16i low = x < floor_;
    x = (v16f)((low & (v16i)floor_) | (~low & (v16i)x));
    // for y <= 0, truncating y - 0.5 rounds y to the nearest integer
    const v16i ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v16i);
    const v16f n = __builtin_convertvector(ni, v16f);
    v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16f p = (v16f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const v16i bits = (ni + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// How many tokens ahead the loops prefetch: a request's slots are scattered over the pool, so each
// row is a cache miss that the hardware prefetcher cannot foresee.
#define PREFETCH_AHEAD 8

// q: [B, Hq, D] float32; k, v: [slots, Hk, D] of kv_kind (KV_F32, KV_BF16, KV_FP8_E4M3); page_table: [rows, pt_stride] int32
// token slots; rows, lens: [B] int64; out: [B, Hq, D] float32.
void decode_attention(const float *q, const void *k, const void *v, int kv_kind, const int32_t *page_table,
                      int64_t pt_stride, const int64_t *rows, const int64_t *lens, float *out, int B, int Hq,
                      int Hk, int D, float scale, int num_threads) {
    const int G = Hq / Hk, vec = D % 16 == 0, nv = D / 16, esize = kv_kind == KV_F32 ? 4 : kv_kind == KV_BF16 ? 2 : 1;
    const int64_t row_bytes = (int64_t)Hk * D * esize;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int b = 0; b < B; ++b) {
        const int64_t L = lens[b];
        const int32_t *slots = page_table + rows[b] * pt_stride;
        const float *qb = q + (int64_t)b * Hq * D;
        float *ob = out + (int64_t)b * Hq * D;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(Hq * L));
        // scores[j, t] = q_j . k_t * scale, every head of a token's row at once (one contiguous read)
        for (int64_t t = 0; t < L; ++t) {
            if (t + PREFETCH_AHEAD < L) {
                const char *next = (const char *)k + (int64_t)slots[t + PREFETCH_AHEAD] * row_bytes;
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
            }
            for (int h = 0; h < Hk; ++h) {
                const int64_t base = ((int64_t)slots[t] * Hk + h) * D;
                if (vec && nv <= 8) {
                    // the head's K vectors widened once for its G queries
                    v16f kv[8];
                    for (int c = 0; c < nv; ++c) kv[c] = load16(k, base + 16 * c, kv_kind);
                    for (int g = 0; g < G; ++g) {
                        const int j = h * G + g;
                        const float *qj = qb + (int64_t)j * D;
                        v16f acc = *(const v16f *)qj * kv[0];
                        for (int c = 1; c < nv; ++c) acc += *(const v16f *)(qj + 16 * c) * kv[c];
                        scores[j * L + t] = hsum(acc) * scale;
                    }
                    continue;
                }
                for (int g = 0; g < G; ++g) {
                    const int j = h * G + g;
                    const float *qj = qb + (int64_t)j * D;
                    float s = 0.f;
                    if (vec) {
                        v16f acc = {0};
                        for (int c = 0; c < nv; ++c)
                            acc += *(const v16f *)(qj + 16 * c) * load16(k, base + 16 * c, kv_kind);
                        s = hsum(acc);
                    } else {
                        for (int d = 0; d < D; ++d) s += qj[d] * load1(k, base + d, kv_kind);
                    }
                    scores[j * L + t] = s * scale;
                }
            }
        }
        for (int j = 0; j < Hq; ++j) {
            float *sj = scores + j * L, m = -INFINITY, sum = 0.f;
            for (int64_t t = 0; t < L; ++t) m = sj[t] > m ? sj[t] : m;
            int64_t t = 0;
            for (; t + 16 <= L; t += 16) {
                const v16f e = exp16(*(v16f *)(sj + t) - m);
                *(v16f *)(sj + t) = e;
                sum += hsum(e);
            }
            for (; t < L; ++t) {
                sj[t] = expf(sj[t] - m);
                sum += sj[t];
            }
            const float inv = 1.f / sum;
            for (t = 0; t < L; ++t) sj[t] *= inv;
        }
        memset(ob, 0, sizeof(float) * (size_t)(Hq * D));
        // out_j = sum_t p[j, t] v_t
        for (int64_t t = 0; t < L; ++t) {
            if (t + PREFETCH_AHEAD < L) {
                const char *next = (const char *)v + (int64_t)slots[t + PREFETCH_AHEAD] * row_bytes;
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
            }
            for (int h = 0; h < Hk; ++h) {
                const int64_t base = ((int64_t)slots[t] * Hk + h) * D;
                float *oh = ob + (int64_t)h * G * D;
                const float *ph = scores + (int64_t)h * G * L + t;
                if (vec) {
                    for (int c = 0; c < nv; ++c) {
                        const v16f vr = load16(v, base + 16 * c, kv_kind);
                        for (int g = 0; g < G; ++g) *(v16f *)(oh + (int64_t)g * D + 16 * c) += ph[g * L] * vr;
                    }
                } else {
                    for (int d = 0; d < D; ++d) {
                        const float vr = load1(v, base + d, kv_kind);
                        for (int g = 0; g < G; ++g) oh[(int64_t)g * D + d] += ph[g * L] * vr;
                    }
                }
            }
        }
        free(scores);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Prefill (and extend over a cached prefix) attention, causal, flash-attention style: a block of a request's
// query rows (its tokens times the query heads of one KV head) goes over its keys a tile of PF_BK at a
// time, with the softmax kept online (a running maximum and sum a row), so scores never fill a
// [queries, context] matrix. K/V are read in place through the page table, each tile read once for every
// query head of its group.
//
// Layouts, chosen so that no loop needs a sum across a vector's lanes: the query block is kept transposed,
// qt[d][m] (done once a block), so the scores come out as st[key][m], 16 rows a vector; the softmax's
// maximum and sum a row are then plain vector maxima and sums over keys. The products with V broadcast
// a probability and multiply a row of V.
//
// Scores, maxima and sums are float32. Float32 queries, or any query over a float32 or FP8 pool: q.k and
// p.v in float32 FMAs. bf16 queries over a bf16 pool compute what torch's SDPA computes for bf16 (its CPU
// flash attention), the reference the engine's greedy tokens were checked with: q.k of bf16 pairs summed
// in float32; the probabilities exp(s - max) of each block of 512 keys rounded to bf16 for the product
// with V (the sum dividing the output taken before the rounding); the output rounded to bf16 once. The
// pair products are `vdpbf16ps` where the CPU has AVX512-BF16 (two bf16 products a lane an instruction,
// each exact in float32), read straight from the pool, and otherwise plain code that adds the same
// products in the same order. Rounding the probabilities costs little accuracy (the outputs' mean error
// against float64 is 7.3e-4 against 6.5e-4 rounding float32 ones) and keeps the bf16 model's near-ties
// where the torch path put them: measured on 500 tokens of random data, 98% of the outputs equal SDPA's
// bit for bit, 79% without it.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PF_BF16_DOT 1
#else
#define PF_BF16_DOT 0
#endif

// keys a tile: SDPA's block of keys, whose maximum the rounded probabilities are relative to; query rows a
// block aims at (tokens times the group's heads): a 500-token prompt still gives dozens of blocks to share
#define PF_BK 512
#define PF_ROWS 96

#define PF_INLINE static inline __attribute__((always_inline))

typedef uint32_t v16w __attribute__((vector_size(64), aligned(4)));

PF_INLINE v16f vmax(v16f a, v16f b) {
    const v16i gt = a > b;
    return (v16f)((gt & (v16i)a) | (~gt & (v16i)b));
}

// 16 floats rounded to bf16 (to nearest even, as f2bf; no NaN here), kept in the words' high halves
PF_INLINE v16w round_bf16(v16f x) {
    v16w u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

// st[j][m0 : m0 + 16 nv] for the 4 keys j0..j0+3 = sum over d of kt[j][d] * qt[d][m], float32
PF_INLINE void pf_scores_f32(const float *qt, const float *kt, float *st, int ld, int D, int j0, int m0, int nv) {
    v16f acc[4][4];
    for (int j = 0; j < 4; ++j)
        for (int c = 0; c < nv; ++c) acc[j][c] = (v16f){0};
    for (int d = 0; d < D; ++d) {
        v16f qv[4];
        for (int c = 0; c < nv; ++c) qv[c] = *(const v16f *)(qt + (int64_t)d * ld + m0 + 16 * c);
        for (int j = 0; j < 4; ++j) {
            const float kj = kt[(int64_t)(j0 + j) * D + d];
            for (int c = 0; c < nv; ++c) acc[j][c] += kj * qv[c];
        }
    }
    for (int j = 0; j < 4; ++j)
        for (int c = 0; c < nv; ++c) *(v16f *)(st + (int64_t)(j0 + j) * ld + m0 + 16 * c) = acc[j][c];
}

// o[m][c0 : c0 + 16 nv] of rows m0..m0+3 = alpha[m] o[m] + sum over the tile's n keys of p[j][m] v[j], float32
PF_INLINE void pf_values_f32(float *o, const float *st, const float *vt, const float *alpha, int ld, int D, int n,
                             int m0, int c0, int nv) {
    v16f acc[4][4];
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < nv; ++c) acc[r][c] = *(const v16f *)(o + (int64_t)(m0 + r) * D + c0 + 16 * c) * alpha[m0 + r];
    for (int j = 0; j < n; ++j) {
        v16f vv[4];
        for (int c = 0; c < nv; ++c) vv[c] = *(const v16f *)(vt + (int64_t)j * D + c0 + 16 * c);
        for (int r = 0; r < 4; ++r) {
            const float p = st[(int64_t)j * ld + m0 + r];
            for (int c = 0; c < nv; ++c) acc[r][c] += p * vv[c];
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < nv; ++c) *(v16f *)(o + (int64_t)(m0 + r) * D + c0 + 16 * c) = acc[r][c];
}

// The bf16 products, one loop for both: for a < 4 and c < nv,
//   out[a * os + 16 c ...] = init (alpha[a] times what out holds, or zero where alpha is NULL)
//                            + sum over p < np of the pair products of x[p * xs + 16 c ...] and w[a][p * ws],
// x and w holding bf16 pairs as words. Scores: x = qt (pairs of d), w[a] = key a's row; values: x = V's rows
// in pairs of keys, w[a] = row a's probabilities in pairs of keys.
#if PF_BF16_DOT
PF_INLINE void pf_dot2(const uint32_t *x, int64_t xs, const uint32_t *const w[4], int64_t ws, int np, float *out,
                       int64_t os, const float *alpha, int nv) {
    v16f acc[4][4];
    for (int a = 0; a < 4; ++a)
        for (int c = 0; c < nv; ++c) acc[a][c] = alpha ? *(const v16f *)(out + a * os + 16 * c) * alpha[a] : (v16f){0};
    for (int p = 0; p < np; ++p) {
        __m512bh xv[4];
        for (int c = 0; c < nv; ++c) xv[c] = (__m512bh)_mm512_loadu_si512((const void *)(x + p * xs + 16 * c));
        for (int a = 0; a < 4; ++a) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32((int)w[a][p * ws]);
            for (int c = 0; c < nv; ++c) acc[a][c] = (v16f)_mm512_dpbf16_ps((__m512)acc[a][c], xv[c], wb);
        }
    }
    for (int a = 0; a < 4; ++a)
        for (int c = 0; c < nv; ++c) *(v16f *)(out + a * os + 16 * c) = acc[a][c];
}
#else
// Without AVX512-BF16: the same products added in vdpbf16ps's order (a lane adds the high element's product,
// then the low one's), so the sums are the same to the bit; kept from the reassociation that the build's
// -fassociative-math allows elsewhere, which would add the two products first.
__attribute__((optimize("no-associative-math"))) static void pf_dot2(const uint32_t *x, int64_t xs,
                                                                  const uint32_t *const w[4], int64_t ws, int np,
                                                                  float *out, int64_t os, const float *alpha,
                                                                  int nv) {
    v16f acc[4][4];
    for (int a = 0; a < 4; ++a)
        for (int c = 0; c < nv; ++c) acc[a][c] = alpha ? *(const v16f *)(out + a * os + 16 * c) * alpha[a] : (v16f){0};
    for (int p = 0; p < np; ++p) {
        v16f hi[4], lo[4];
        for (int c = 0; c < nv; ++c) {
            const v16w xv = *(const v16w *)(x + p * xs + 16 * c), h = xv & 0xffff0000u, l = xv << 16;
            memcpy(&hi[c], &h, sizeof h);
            memcpy(&lo[c], &l, sizeof l);
        }
        for (int a = 0; a < 4; ++a) {
            const uint32_t word = w[a][p * ws];
            const float wh = bf2f((uint16_t)(word >> 16)), wl = bf2f((uint16_t)word);
            for (int c = 0; c < nv; ++c) {
                acc[a][c] += hi[c] * wh;
                acc[a][c] += lo[c] * wl;
            }
        }
    }
    for (int a = 0; a < 4; ++a)
        for (int c = 0; c < nv; ++c) *(v16f *)(out + a * os + 16 * c) = acc[a][c];
}
#endif

// calls `kernel` (whose last argument is nv) for the 64-float chunks of [0, width) and then the last 16, 32
// or 48 floats, nv a constant in each call so that the kernels' loops unroll; c0 names the chunk's start
#define PF_CHUNKS(width, c0, kernel, ...)                    \
    for (int c0 = 0; c0 < (width); c0 += 64) {               \
        const int nv_ = ((width) - c0) / 16;                 \
        if (nv_ >= 4)                                        \
            kernel(__VA_ARGS__, 4);                          \
        else if (nv_ == 3)                                   \
            kernel(__VA_ARGS__, 3);                          \
        else if (nv_ == 2)                                   \
            kernel(__VA_ARGS__, 2);                          \
        else                                                 \
            kernel(__VA_ARGS__, 1);                          \
    }

// a row widened from the pool (float32, bf16 or fp8) into float32; D % 16 == 0
static inline void pf_widen(float *dst, const void *src, int64_t base, int D, int kind) {
    for (int c = 0; c < D; c += 16) *(v16f *)(dst + c) = load16(src, base + c, kind);
}

// per thread: everything one block works on
typedef struct {
    float *qt, *o, *st, *kt, *vt, *m, *l, *alpha;
    int32_t *pos;
    const uint16_t **krows;
} pf_scratch;

// q: [T, Hq, D] float32 (q_kind 0) or bf16 (1), token rows q_stride elements apart, each request's extend[b]
// rows one after another; k, v: [slots, Hk, D] of kv_kind; page_table: [rows, pt_stride] int32 token
// slots; rows, prefix (cached tokens), extend: [B] int64; out: [T, Hq, D] contiguous, of q_kind. Query row t
// of request b sits at position prefix[b] + t and sees the keys at positions 0..prefix[b] + t. Scores are
// q.k * scale (an FP8 pool's K scale folded in by the caller), outputs times v_scale.
// Returns 0, -1 for a shape it does not take (D not a multiple of 16, Hq not a multiple of Hk), -2 out of memory.
int prefill_attention(const void *q, int q_kind, int64_t q_stride, const void *k, const void *v, int kv_kind,
                      const int32_t *page_table, int64_t pt_stride, const int64_t *rows, const int64_t *prefix,
                      const int64_t *extend, void *out, int B, int Hq, int Hk, int D, float scale, float v_scale,
                      int num_threads) {
    if (D % 16 || D <= 0 || Hk <= 0 || Hq % Hk) return -1;
    const int G = Hq / Hk, bf16 = q_kind == 1 && kv_kind == KV_BF16;
    const int BQ = G >= PF_ROWS ? 1 : PF_ROWS / G < 32 ? PF_ROWS / G : 32;
    // rows of a block padded to whole vectors; the padding rows have q = 0 and see every key
    const int ld = (BQ * G + 15) / 16 * 16;
    const int64_t esize = kv_kind == KV_F32 ? 4 : kv_kind == KV_BF16 ? 2 : 1;
    int64_t nblocks = 0;
    for (int b = 0; b < B; ++b) nblocks += (extend[b] + BQ - 1) / BQ;
    // each block: its request, its first query row, the request's first packed row
    int64_t *blk = malloc(sizeof(int64_t) * (size_t)(3 * nblocks + 1));
    uint16_t *zeros = calloc((size_t)D, sizeof(uint16_t));
    int rc = blk && zeros ? 0 : -2;
    if (!rc) {
        int64_t i = 0, start = 0;
        for (int b = 0; b < B; ++b) {
            for (int64_t t = 0; t < extend[b]; t += BQ, ++i) {
                blk[3 * i] = b;
                blk[3 * i + 1] = t;
                blk[3 * i + 2] = start;
            }
            start += extend[b];
        }
    }
    const int64_t items = rc ? 0 : nblocks * Hk;
#pragma omp parallel num_threads(num_threads) if (items > 1)
    {
        pf_scratch s = {0};
        const size_t floats = (size_t)ld * D * 2 + (size_t)PF_BK * ld + (size_t)PF_BK * D * 2 + (size_t)ld * 3;
        float *mem = items ? aligned_alloc(64, (floats * sizeof(float) + (size_t)ld * 4 + 63) / 64 * 64) : NULL;
        s.krows = items ? malloc(sizeof(uint16_t *) * PF_BK) : NULL;
        if (items && (!mem || !s.krows)) {
#pragma omp atomic write
            rc = -2;
        }
        if (mem) {
            s.qt = mem;
            s.o = s.qt + (size_t)ld * D;
            s.st = s.o + (size_t)ld * D;
            s.kt = s.st + (size_t)PF_BK * ld;
            s.vt = s.kt + (size_t)PF_BK * D;
            s.m = s.vt + (size_t)PF_BK * D;
            s.l = s.m + ld;
            s.alpha = s.l + ld;
            s.pos = (int32_t *)(s.alpha + ld);
        }
        // bf16: V's tile in pairs of keys, where the float tile would be
        uint32_t *vp = (uint32_t *)s.vt;
        // the blocks with the most keys (last in each request) first, so the threads finish together
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = items - 1; it >= 0; --it) {
            if (!mem || !s.krows) continue;
            const int64_t bi = it / Hk;
            const int h = (int)(it % Hk), b = (int)blk[3 * bi];
            const int64_t q0 = blk[3 * bi + 1], first = blk[3 * bi + 2] + q0;
            const int nq = (int)(extend[b] - q0 < BQ ? extend[b] - q0 : BQ), M = nq * G;
            const int64_t P = prefix[b] + q0, nkeys = P + nq;
            const int32_t *slots = page_table + rows[b] * pt_stride;
            // the block's queries, transposed: qt[d][m] (float32) or qt[p][m] (bf16 pairs)
            memset(s.qt, 0, sizeof(float) * (size_t)ld * D);
            for (int m = 0; m < M; ++m) {
                const int64_t base = (first + m / G) * q_stride + (int64_t)(h * G + m % G) * D;
                if (bf16) {
                    const uint16_t *qr = (const uint16_t *)q + base;
                    for (int p = 0; p < D / 2; ++p) memcpy((uint32_t *)s.qt + (int64_t)p * ld + m, qr + 2 * p, 4);
                } else {
                    for (int d = 0; d < D; ++d) s.qt[(int64_t)d * ld + m] = load1(q, base + d, q_kind);
                }
            }
            for (int m = 0; m < ld; ++m) {
                s.pos[m] = m < M ? (int32_t)(P + m / G) : INT32_MAX;
                s.m[m] = -INFINITY;
                s.l[m] = 0.f;
            }
            memset(s.o, 0, sizeof(float) * (size_t)ld * D);
            for (int64_t kt0 = 0; kt0 < nkeys; kt0 += PF_BK) {
                const int n = (int)(nkeys - kt0 < PF_BK ? nkeys - kt0 : PF_BK), n4 = (n + 3) / 4 * 4;
                for (int j = 0; j < n4; ++j) {
                    if (j + PREFETCH_AHEAD < n) {
                        const int64_t ahead = ((int64_t)slots[kt0 + j + PREFETCH_AHEAD] * Hk + h) * D * esize;
                        __builtin_prefetch((const char *)k + ahead);
                        __builtin_prefetch((const char *)v + ahead);
                    }
                    const int64_t base = j < n ? ((int64_t)slots[kt0 + j] * Hk + h) * D : -1;
                    if (bf16) {
                        s.krows[j] = base < 0 ? zeros : (const uint16_t *)k + base;
                    } else if (base < 0) {
                        memset(s.kt + (int64_t)j * D, 0, sizeof(float) * D);
                    } else {
                        pf_widen(s.kt + (int64_t)j * D, k, base, D, kv_kind);
                        pf_widen(s.vt + (int64_t)j * D, v, base, D, kv_kind);
                    }
                }
                // bf16: V's rows in pairs of keys, vp[i][d] = (v[2i][d], v[2i + 1][d]); past the tile's end, zero
                for (int i = 0; bf16 && i < (n + 1) / 2; ++i) {
                    const uint16_t *v0 = (const uint16_t *)v + ((int64_t)slots[kt0 + 2 * i] * Hk + h) * D;
                    const uint16_t *v1 =
                        2 * i + 1 < n ? (const uint16_t *)v + ((int64_t)slots[kt0 + 2 * i + 1] * Hk + h) * D : zeros;
                    for (int d = 0; d < D; ++d) vp[(int64_t)i * D + d] = (uint32_t)v1[d] << 16 | v0[d];
                }
                // st[j][m] = q_m . k_j
                for (int j0 = 0; j0 < n4; j0 += 4) {
                    if (bf16) {
                        const uint32_t *w[4];
                        for (int a = 0; a < 4; ++a) w[a] = (const uint32_t *)s.krows[j0 + a];
                        PF_CHUNKS(ld, c0, pf_dot2, (const uint32_t *)s.qt + c0, ld, w, 1, D / 2,
                                  s.st + (int64_t)j0 * ld + c0, ld, NULL)
                    } else {
                        PF_CHUNKS(ld, c0, pf_scores_f32, s.qt, s.kt, s.st, ld, D, j0, c0)
                    }
                }
                // online softmax, 16 rows at a time: keys past a row's position are masked out
                const v16f neg_inf = (v16f){0} - INFINITY;
                for (int m0 = 0; m0 < ld; m0 += 16) {
                    v16i pos;
                    memcpy(&pos, s.pos + m0, sizeof pos);
                    const v16f m_old = *(const v16f *)(s.m + m0);
                    v16f mx = neg_inf;
                    for (int j = 0; j < n; ++j) {
                        const v16i ok = pos >= (int32_t)(kt0 + j);
                        v16f *sj = (v16f *)(s.st + (int64_t)j * ld + m0);
                        const v16f x = (v16f)((ok & (v16i)(*sj * scale)) | (~ok & (v16i)neg_inf));
                        *sj = x;
                        mx = vmax(mx, x);
                    }
                    const v16f m_new = vmax(m_old, mx), alpha = exp16(m_old - m_new);
                    v16f sum = (v16f){0};
                    for (int j = 0; j < n; ++j) {
                        const v16i ok = pos >= (int32_t)(kt0 + j);
                        v16f *sj = (v16f *)(s.st + (int64_t)j * ld + m0);
                        // exp16 clamps -inf to a tiny value, not zero: the mask sets masked keys to zero
                        const v16f p = (v16f)(ok & (v16i)exp16(*sj - m_new));
                        sum += p;
                        if (!bf16) {
                            *sj = p;
                        } else if (j % 2 == 0) {
                            *(v16w *)sj = round_bf16(p) >> 16;
                        } else {
                            // the pair's word goes to row j / 2, which is read already (j / 2 < j - 1, or row 0)
                            const v16w pair = *(const v16w *)(s.st + (int64_t)(j - 1) * ld + m0) | round_bf16(p);
                            *(v16w *)(s.st + (int64_t)(j / 2) * ld + m0) = pair;
                        }
                    }
                    if (bf16 && n % 2) {
                        const v16w last = *(const v16w *)(s.st + (int64_t)(n - 1) * ld + m0);
                        *(v16w *)(s.st + (int64_t)(n / 2) * ld + m0) = last;
                    }
                    *(v16f *)(s.m + m0) = m_new;
                    *(v16f *)(s.l + m0) = *(const v16f *)(s.l + m0) * alpha + sum;
                    *(v16f *)(s.alpha + m0) = alpha;
                }
                // o[m] = alpha[m] o[m] + sum_j p[j][m] v_j
                for (int m0 = 0; m0 < ld; m0 += 4) {
                    if (bf16) {
                        // st's first (n + 1) / 2 rows hold the probabilities in pairs of keys now
                        const uint32_t *w[4];
                        for (int a = 0; a < 4; ++a) w[a] = (const uint32_t *)s.st + m0 + a;
                        PF_CHUNKS(D, c0, pf_dot2, vp + c0, D, w, ld, (n + 1) / 2, s.o + (int64_t)m0 * D + c0, D,
                                  s.alpha + m0)
                    } else {
                        PF_CHUNKS(D, c0, pf_values_f32, s.o, s.st, s.vt, s.alpha, ld, D, n, m0, c0)
                    }
                }
            }
            for (int m = 0; m < M; ++m) {
                const float inv = v_scale / s.l[m];
                const float *om = s.o + (int64_t)m * D;
                const int64_t base = ((first + m / G) * Hq + h * G + m % G) * D;
                if (q_kind == 1) {
                    for (int d = 0; d < D; ++d) ((uint16_t *)out)[base + d] = f2bf(om[d] * inv);
                } else {
                    for (int d = 0; d < D; ++d) ((float *)out)[base + d] = om[d] * inv;
                }
            }
        }
        free(mem);
        free(s.krows);
    }
    free(blk);
    free(zeros);
    return rc;
}
