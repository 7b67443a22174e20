// Attention for the CPU, read in place from the paged KV pool through the page table (no gather into a
// padded batch): decode (each request's one query over its context) and, further down, prefill.
//
// Plain C with OpenMP, called through ctypes: it builds in about a second with gcc and needs no
// torch headers. Decode: work is split over requests; a token's K (and V) row of every head is read once
// and the rows ahead are prefetched. Rows are handled as 16-float vectors (GCC vector extensions, which the
// compiler maps to AVX-512, AVX2 or SSE; a head_dim that is not a multiple of 16 takes the scalar loop), or,
// for bf16 queries over a bf16 pool where the CPU has AVX512-BF16, as bf16 pairs in AVX-512 intrinsics.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

// `vdpbf16ps` (two bf16 products a lane an instruction, each exact in float32) where the CPU has AVX512-BF16
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

// for the loops whose bounds each call site makes constants: inlined, they unroll and keep their
// accumulators in registers
#define ALWAYS_INLINE static inline __attribute__((always_inline))

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

// q: [B, Hq, D] float32 (q_kind 0) or bf16 (1), requests q_stride elements apart, heads contiguous; k, v:
// [slots, Hk, D] of kv_kind (KV_F32, KV_BF16, KV_FP8_E4M3); page_table: [rows, pt_stride] int32 token slots;
// rows, lens: [B] int64; out: [B, Hq, D] float32.
//
// Two passes over each request's context: the scores of all its query heads (K read once), their softmax,
// then the products with V (V read once); the scores of one request sit in a per-thread buffer.
//
// bf16 queries over a bf16 pool compute what torch's SDPA computes for bf16, as the prefill kernel does (below):
// the probabilities rounded to bf16 for the product with V. With D % 32 == 0, where the CPU has AVX512-BF16,
// they take decode_bf16: q.k and p.v by `vdpbf16ps`. Everything else takes decode_f32: float32 FMAs on rows
// widened from the pool, its probabilities rounded only for bf16 queries over a bf16 pool; float32 queries
// (a float32 model's, whose tokens are checked against transformers) keep float32 throughout.

// per thread: one request's scores and probabilities, and its queries in the layout its path reads
typedef struct {
    float *scores;    // [Hq, lp] scores, then probabilities (decode_f32)
    uint32_t *pairs;  // [Hq, lp / 2] decode_bf16: the bf16 probabilities of tokens 2i and 2i + 1 as one word
    float *qf;        // [Hq, D] decode_f32: bf16 queries widened
    uint32_t *qb;     // [Hq, D / 8, 16] decode_bf16: each 4 bf16 pairs of q repeated in the 4 128-bit blocks
    uint16_t *zeros;  // [Hk, D] decode_bf16: the row read in place of a token past the context
    float *acc;       // [Hq, D] decode_bf16: the outputs' sums, in dec_values' order of d
    float *inv;       // [Hq] decode_bf16: 1 / the softmax's sum
} dec_scratch;

static void decode_f32(const float *qb, const void *k, const void *v, int kv_kind, const int32_t *slots, int64_t L,
                       float *ob, int Hq, int Hk, int D, float scale, int round_p, float *scores) {
    const int G = Hq / Hk, vec = D % 16 == 0, nv = D / 16, esize = kv_kind == KV_F32 ? 4 : kv_kind == KV_BF16 ? 2 : 1;
    const int64_t row_bytes = (int64_t)Hk * D * esize;
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
        for (t = 0; t < L; ++t) sj[t] = (round_p ? bf2f(f2bf(sj[t])) : sj[t]) * inv;
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
}

// Rows in flight for decode_bf16, which computes faster than memory hands it rows (each a miss that the hardware
// prefetcher cannot foresee, as slots are scattered). A cursor goes over the rows a thread reads in the order it
// reads them (a request's K rows, then its V rows, then the next request's), DEC_AHEAD rows in front of the
// loops, which move it a tile's rows at a time spread over the tile's heads. On 64 requests of 32-160 tokens,
// their K/V out of the caches, a layer takes within ~10% of a loop that only reads the same rows in that order.
#define DEC_AHEAD 32

typedef struct {
    const char *k, *v;
    const int32_t *page_table;
    const int64_t *rows, *lens;
    int64_t pt_stride, row_bytes;
    int64_t t;         // the token under the cursor
    int b, b1, phase;  // its request (b1: past the chunk's last), in its K rows (phase 0) or V rows (1)
} dec_cursor;

// prefetches the next n rows under the cursor and moves it past them
static inline void dec_prefetch(dec_cursor *c, int n) {
    for (int i = 0; i < n; ++i) {
        while (c->b < c->b1 && c->t == c->lens[c->b]) {
            c->t = 0;
            c->phase ^= 1;
            if (!c->phase) ++c->b;
        }
        if (c->b == c->b1) return;
        const int64_t slot = c->page_table[c->rows[c->b] * c->pt_stride + c->t++];
        const char *r = (c->phase ? c->v : c->k) + slot * c->row_bytes;
        for (int64_t off = 0; off < c->row_bytes; off += 64) __builtin_prefetch(r + off);
    }
}

#if BF16_DOT
// a + b reduced a level of a transposing tree: where mask m is clear the lanes of a, where set those of b, each
// plus its partner lane `swap` away (a _mm512_permute_ps pattern)
#define DEC_FOLD(a, b, m, swap) \
    _mm512_add_ps(_mm512_mask_blend_ps(m, a, b), _mm512_permute_ps(_mm512_mask_blend_ps(m, b, a), swap))

// Scores of 16 tokens with ng <= 4 query heads of one KV head: st[g * ls + i] = q_g . k_i * scale, -inf for the
// tokens past `valid`. Sums across lanes are what a q.k dot costs most; here they are shared: the rows go in
// fours, transposed by 128-bit blocks (8 bf16) so that a vector holds one block of each of 4 rows, and its
// product with the same block of q (repeated in all 4: qb) leaves 4 partial sums of each of 4 tokens in their
// own block; the 4 vectors of 16 tokens then fold into one in two levels. rows: the 16 tokens' rows in the order
// that the folds leave them in token order: rows[4 a + i] is token 4 i + {0, 2, 1, 3}[a]; read from off on.
ALWAYS_INLINE void dec_scores16(const uint16_t *const rows[16], int64_t off, const __m512i *qb, int64_t qs, int nz,
                                float scale, __mmask16 valid, float *st, int64_t ls, int ng) {
    __m512 acc[4][4];
    for (int a = 0; a < 4; ++a)
        for (int g = 0; g < ng; ++g) acc[a][g] = _mm512_setzero_ps();
    for (int c = 0; c < nz; ++c) {
#pragma GCC unroll 4
        for (int a = 0; a < 4; ++a) {
            const int64_t o = off + 32 * c;
            const __m512i r0 = _mm512_loadu_si512(rows[4 * a] + o), r1 = _mm512_loadu_si512(rows[4 * a + 1] + o);
            const __m512i r2 = _mm512_loadu_si512(rows[4 * a + 2] + o), r3 = _mm512_loadu_si512(rows[4 * a + 3] + o);
            const __m512i t0 = _mm512_shuffle_i32x4(r0, r1, 0x44), t1 = _mm512_shuffle_i32x4(r0, r1, 0xee);
            const __m512i t2 = _mm512_shuffle_i32x4(r2, r3, 0x44), t3 = _mm512_shuffle_i32x4(r2, r3, 0xee);
            const __m512i x[4] = {_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t0, t2, 0xdd),
                                  _mm512_shuffle_i32x4(t1, t3, 0x88), _mm512_shuffle_i32x4(t1, t3, 0xdd)};
#pragma GCC unroll 4
            for (int g = 0; g < ng; ++g)
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    acc[a][g] = _mm512_dpbf16_ps(acc[a][g], (__m512bh)x[j], (__m512bh)qb[g * qs + 4 * c + j]);
        }
    }
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), s = _mm512_set1_ps(scale);
#pragma GCC unroll 4
    for (int g = 0; g < ng; ++g) {
        const __m512 lo = DEC_FOLD(acc[0][g], acc[1][g], 0xcccc, 0x4e);
        const __m512 hi = DEC_FOLD(acc[2][g], acc[3][g], 0xcccc, 0x4e);
        const __m512 sum = DEC_FOLD(lo, hi, 0xaaaa, 0xb1);
        _mm512_storeu_ps(st + g * ls, _mm512_mask_mul_ps(neg_inf, valid, sum, s));
    }
}

// acc[g][...] += sum over np pairs of tokens of p[g][pair] . (v_2i, v_2i+1) for ng <= 4 query heads and nz <= 2
// vectors of 32 bf16 of V (from the rows' offset on): V's rows interleaved to (v_2i[d], v_2i+1[d]) words, dotted
// with the pair's probability word. Interleaving by 128-bit blocks leaves d in the order 0-3, 8-11, ... (the
// unpacklo half, acc[g][2c]) and 4-7, 12-15, ... (unpackhi, acc[g][2c + 1]); dec_finish puts it back.
ALWAYS_INLINE void dec_values(const uint16_t *const *rows, int np, int64_t off, const uint32_t *pairs, int64_t ps,
                              float *acc, int64_t as, int nz, int ng) {
    __m512 a[4][4];
    for (int g = 0; g < ng; ++g)
        for (int c = 0; c < 2 * nz; ++c) a[g][c] = _mm512_loadu_ps(acc + g * as + 16 * c);
    for (int i = 0; i < np; ++i) {
#pragma GCC unroll 2
        for (int c = 0; c < nz; ++c) {
            const __m512i x = _mm512_loadu_si512(rows[2 * i] + off + 32 * c);
            const __m512i y = _mm512_loadu_si512(rows[2 * i + 1] + off + 32 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 4
            for (int g = 0; g < ng; ++g) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pairs[g * ps + i]);
                a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], lo, p);
                a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], hi, p);
            }
        }
    }
    for (int g = 0; g < ng; ++g)
        for (int c = 0; c < 2 * nz; ++c) _mm512_storeu_ps(acc + g * as + 16 * c, a[g][c]);
}

// out[d] = acc's row (dec_values' order, D floats) in the order of d, times w
static inline void dec_finish(const float *acc, float w, int D, float *out) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 s = _mm512_set1_ps(w);
    for (int c = 0; c < D; c += 32) {
        const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
        _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), s));
        _mm512_storeu_ps(out + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), s));
    }
}

// calls `fn(..., ng)` with ng = the call's number of query heads, 1 to 4, a constant in each call
#define DEC_HEADS(n, fn, ...)               \
    switch (n) {                            \
        case 1: fn(__VA_ARGS__, 1); break;  \
        case 2: fn(__VA_ARGS__, 2); break;  \
        case 3: fn(__VA_ARGS__, 3); break;  \
        default: fn(__VA_ARGS__, 4); break; \
    }

// bf16 q (heads contiguous) over a bf16 pool, D % 32 == 0. q.k of bf16 pairs summed in float32 (each product
// exact); the probabilities exp(s - max) rounded to bf16 for the product with V, the sum dividing the output
// taken before the rounding: what torch's SDPA computes for bf16 up to a context of 512 (its block of keys),
// the order of the float32 sums aside. Both passes go a tile of 16 tokens at a time, all heads of a tile
// together, so that the rows are read in the cursor's order.
static void decode_bf16(const uint16_t *qb, const uint16_t *k, const uint16_t *v, const int32_t *slots, int64_t L,
                        float *ob, int Hq, int Hk, int D, float scale, dec_scratch *s, dec_cursor *cur) {
    const int G = Hq / Hk, nz = D / 32, qs = D / 8;
    const int64_t row = (int64_t)Hk * D, lp = (L + 15) / 16 * 16;
    __m512i *qv = (__m512i *)s->qb;
    for (int j = 0; j < Hq; ++j)
        for (int i = 0; i < qs; ++i)
            qv[j * qs + i] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qb + (int64_t)j * D + 8 * i)));
    // the order in which dec_scores16 takes a tile's rows
    static const int order[16] = {0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15};
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? (int)(L - t0) : 16;
        const uint16_t *rows[16];
        for (int i = 0; i < 16; ++i) rows[i] = order[i] < n ? k + slots[t0 + order[i]] * row : s->zeros;
        for (int h = 0; h < Hk; ++h) {
            // this tile's share of the prefetches, spread over its heads
            dec_prefetch(cur, (int)((int64_t)n * (h + 1) / Hk - (int64_t)n * h / Hk));
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int j = h * G + g0;
                DEC_HEADS(G - g0, dec_scores16, rows, h * D, qv + (int64_t)j * qs, qs, nz, scale,
                          (__mmask16)((1u << n) - 1), s->scores + j * lp + t0, lp)
            }
        }
    }
    for (int j = 0; j < Hq; ++j) {
        const float *sj = s->scores + j * lp;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sj + t));
        const v16f mx = (v16f)_mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < lp; t += 16) {
            // past the context the scores are -inf, which exp16 takes to a tiny number, not zero
            const __mmask16 valid = L - t < 16 ? (__mmask16)((1u << (L - t)) - 1) : 0xffff;
            const __m512 p = _mm512_maskz_mov_ps(valid, (__m512)exp16(*(const v16f *)(sj + t) - mx));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256((__m256i *)(s->pairs + j * lp / 2 + t / 2), (__m256i)_mm512_cvtneps_pbh(p));
        }
        s->inv[j] = 1.f / _mm512_reduce_add_ps(sum);
    }
    memset(s->acc, 0, sizeof(float) * (size_t)Hq * D);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? (int)(L - t0) : 16;
        // an odd last token's pair: zeros (its slot may hold anything, NaN included), times a probability of zero
        const uint16_t *rows[17];
        for (int i = 0; i < n; ++i) rows[i] = v + slots[t0 + i] * row;
        rows[n] = s->zeros;
        for (int h = 0; h < Hk; ++h) {
            // this tile's share of the prefetches, spread over its heads
            dec_prefetch(cur, (int)((int64_t)n * (h + 1) / Hk - (int64_t)n * h / Hk));
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int j = h * G + g0;
                for (int c0 = 0; c0 < D; c0 += 64)
                    DEC_HEADS(G - g0, dec_values, rows, (n + 1) / 2, h * D + c0, s->pairs + j * lp / 2 + t0 / 2,
                              lp / 2, s->acc + j * D + c0, D, D - c0 >= 64 ? 2 : 1)
            }
        }
    }
    for (int j = 0; j < Hq; ++j) dec_finish(s->acc + j * D, s->inv[j], D, ob + (int64_t)j * D);
}
#endif

int decode_attention(const void *q, int q_kind, int64_t q_stride, const void *k, const void *v, int kv_kind,
                     const int32_t *page_table, int64_t pt_stride, const int64_t *rows, const int64_t *lens, float *out,
                     int B, int Hq, int Hk, int D, float scale, int num_threads) {
    const int bf16 = BF16_DOT && q_kind == 1 && kv_kind == KV_BF16 && D % 32 == 0;
    int64_t lmax = 0;
    for (int b = 0; b < B; ++b) lmax = lens[b] > lmax ? lens[b] : lmax;
    const int64_t lp = (lmax + 15) / 16 * 16;
    // a thread goes through a chunk of requests in order, its prefetches running ahead from one request into the
    // next; with several threads, four chunks a thread even out requests of different lengths
    const int chunk = num_threads > 1 ? (B + 4 * num_threads - 1) / (4 * num_threads) : B > 0 ? B : 1;
    const int nchunks = (B + chunk - 1) / chunk;
    int rc = 0;
#pragma omp parallel num_threads(num_threads) if (nchunks > 1)
    {
        // floats: qb, scores, pairs, qf, acc, inv; then the zero row
        const size_t floats = (size_t)Hq * (2 * D + lp + lp / 2 + D + D + 1);
        float *mem = aligned_alloc(64, (floats * 4 + (size_t)Hk * D * 2 + 63) / 64 * 64);
        if (!mem) {
#pragma omp atomic write
            rc = -2;
        }
        dec_scratch s = {0};
        if (mem) {
            s.qb = (uint32_t *)mem;
            s.scores = mem + (size_t)Hq * 2 * D;
            s.pairs = (uint32_t *)(s.scores + (size_t)Hq * lp);
            s.qf = (float *)(s.pairs + (size_t)Hq * lp / 2);
            s.acc = s.qf + (size_t)Hq * D;
            s.inv = s.acc + (size_t)Hq * D;
            s.zeros = (uint16_t *)(s.inv + Hq);
            memset(s.zeros, 0, sizeof(uint16_t) * (size_t)Hk * D);
        }
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < nchunks; ++c) {
            const int b1 = (c + 1) * chunk < B ? (c + 1) * chunk : B;
            dec_cursor cur = {k, v, page_table, rows, lens, pt_stride, (int64_t)Hk * D * 2, 0, c * chunk, b1, 0};
            if (bf16) dec_prefetch(&cur, DEC_AHEAD);
            for (int b = c * chunk; b < b1 && mem; ++b) {
                const int32_t *slots = page_table + rows[b] * pt_stride;
                const void *qb = (const char *)q + (int64_t)b * q_stride * (q_kind == 1 ? 2 : 4);
                float *ob = out + (int64_t)b * Hq * D;
                if (lens[b] <= 0) {
                    // nothing to attend to: zeros, where the softmax's sum would divide by zero
                    memset(ob, 0, sizeof(float) * (size_t)Hq * D);
                    continue;
                }
#if BF16_DOT
                if (bf16) {
                    decode_bf16(qb, k, v, slots, lens[b], ob, Hq, Hk, D, scale, &s, &cur);
                    continue;
                }
#endif
                const float *qf = qb;
                if (q_kind == 1) {
                    for (int i = 0; i < Hq * D; ++i) s.qf[i] = bf2f(((const uint16_t *)qb)[i]);
                    qf = s.qf;
                }
                decode_f32(qf, k, v, kv_kind, slots, lens[b], ob, Hq, Hk, D, scale, q_kind == 1 && kv_kind == KV_BF16,
                           s.scores);
            }
        }
        free(mem);
    }
    return rc;
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

// keys a tile: SDPA's block of keys, whose maximum the rounded probabilities are relative to; query rows a
// block aims at (tokens times the group's heads): a 500-token prompt still gives dozens of blocks to share
#define PF_BK 512
#define PF_ROWS 96

typedef uint32_t v16w __attribute__((vector_size(64), aligned(4)));

ALWAYS_INLINE v16f vmax(v16f a, v16f b) {
    const v16i gt = a > b;
    return (v16f)((gt & (v16i)a) | (~gt & (v16i)b));
}

// 16 floats rounded to bf16 (to nearest even, as f2bf; no NaN here), kept in the words' high halves
ALWAYS_INLINE v16w round_bf16(v16f x) {
    v16w u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

// st[j][m0 : m0 + 16 nv] for the 4 keys j0..j0+3 = sum over d of kt[j][d] * qt[d][m], float32
ALWAYS_INLINE void pf_scores_f32(const float *qt, const float *kt, float *st, int ld, int D, int j0, int m0, int nv) {
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
ALWAYS_INLINE void pf_values_f32(float *o, const float *st, const float *vt, const float *alpha, int ld, int D, int n,
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
#if BF16_DOT
ALWAYS_INLINE void pf_dot2(const uint32_t *x, int64_t xs, const uint32_t *const w[4], int64_t ws, int np, float *out,
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
