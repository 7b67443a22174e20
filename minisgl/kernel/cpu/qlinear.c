// y = x w^T for a few rows of x against int4 (GGUF Q4_0 / Q4_1 / Q4_K) or int8 weights, with x rounded
// to int8 in blocks of 32 and the products summed in int32: llama.cpp's way for a decode step.
//
// At one to four rows a layer's time is the time to read its weights. torch's int4 kernel widens the
// codes to bf16 and multiplies in floating point, which costs more than the read; here 128 codes are
// one 64-byte load and two masks, and 64 products one integer dot-product instruction (AVX512-VNNI
// `vpdpbusd`: unsigned codes times signed activations, four a lane). The activations' rounding to int8
// (one scale a block of 32) is the price: the numbers are llama.cpp's, not bf16's.
//
// Layouts. Activations keep K's order; each block of 32 has a scale. An int4 weight row is cut into chunks
// of four blocks (128 values, 64 bytes) and, where K / 32 is not a multiple of four, a last chunk of two
// (64 values, 32 bytes); byte t of a chunk of S values holds value t in its low nibble and value t + S/2
// in its high one. So one load and two masks give two registers of 64 codes in K's order, each a pair of
// blocks: lanes 0-7 of a register belong to its first block, 8-15 to its second. Its block scales and
// offsets are float16 (as a GGUF file's). Int8 weights are stored plus 128 (the instruction's first
// operand is unsigned), in K's order, with a float32 scale a row.
//
// Without AVX512-VNNI the same sums are computed by plain loops (so the tests run on any machine; callers
// use the torch kernels there: `qlinear_fast()` says which).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QL_VNNI 1
#include <immintrin.h>
#else
#define QL_VNNI 0
#endif

#define QL_INLINE static inline __attribute__((always_inline))

int qlinear_fast(void) { return QL_VNNI; }

// IEEE half to float, for the plain path (the vector path converts with F16C)
static inline float ql_h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);
    } else if (exp == 31) {
        f = man ? NAN : INFINITY;
    } else {
        const uint32_t u = ((exp + 112) << 23) | (man << 13);
        memcpy(&f, &u, sizeof f);
    }
    return sign ? -f : f;
}

static inline void ql_store(void *y, int y_kind, int64_t i, float v) {
    if (y_kind == 1)
        ((uint16_t *)y)[i] = f2bf(v);
    else
        ((float *)y)[i] = v;
}

// x: [M, K] float32 (x_kind 0) or bf16 (1), rows ld apart; K % 64 == 0.
// q: [M, K] int8; dx: [M, K/32] the blocks' scales (amax / 127); sx: [M, K/32] dx times the sum of the
// block's codes; dxe: [M, K/64, 16] each pair of blocks' scales spread over a register's lanes.
void quantize_q8_blocks(const void *x, int x_kind, int64_t ld, int8_t *q, float *dx, float *sx, float *dxe,
                        int M, int K, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M > 1 && num_threads > 1)
    for (int m = 0; m < M; ++m) {
        float v[32];
        for (int b = 0; b < K / 32; ++b) {
            const int64_t base = (int64_t)m * ld + 32 * b;
            if (x_kind == 1)
                for (int j = 0; j < 32; ++j) v[j] = bf2f(((const uint16_t *)x)[base + j]);
            else
                memcpy(v, (const float *)x + base, sizeof v);
            // comparisons, not fmaxf: that is a library call where NaNs are allowed and does not vectorise
            float amax = 0.0f;
            for (int j = 0; j < 32; ++j) {
                const float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f;
            int8_t *qb = q + (int64_t)m * K + 32 * b;
            int sum = 0;
            for (int j = 0; j < 32; ++j) {
                // rintf rounds half to even, as torch.round; a block of zeros has scale 0 and codes 0
                const int c = d > 0.0f ? (int)rintf(v[j] / d) : 0;
                qb[j] = (int8_t)c;
                sum += c;
            }
            dx[(int64_t)m * (K / 32) + b] = d;
            sx[(int64_t)m * (K / 32) + b] = d * (float)sum;
        }
        for (int p = 0; p < K / 64; ++p) {
            float *e = dxe + ((int64_t)m * (K / 64) + p) * 16;
            for (int l = 0; l < 16; ++l) e[l] = dx[(int64_t)m * (K / 32) + 2 * p + (l >> 3)];
        }
    }
}

#if QL_VNNI
// scales of blocks i and i + 1 of the four in d, spread over a pair's register: i in lanes 0-7
QL_INLINE __m512 ql_spread(__m128 d, int i) {
    const __m512i idx =
        _mm512_set_epi32(i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i, i, i, i, i, i, i, i);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d));
}

// the sums of four registers' lanes, [sum(a), sum(b), sum(c), sum(d)]: a third of four full reductions
QL_INLINE __m128 ql_sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[m][r] += the products of one pair of blocks: codes c[r] (weight scales s[r], int4 only) times the
// activations' pair at q + 64 * p (scales e)
QL_INLINE void ql_pair(__m512 acc[2][4], const __m512i c[4], const __m512 s[4], const int8_t *q,
                       const float *dxe, int q4, int M, int R, int K, int p) {
    const int np = K / 64;
    const __m512i z = _mm512_setzero_si512();
    for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512((const void *)(q + (int64_t)m * K + 64 * p));
        const __m512 e = _mm512_loadu_ps(dxe + ((int64_t)m * np + p) * 16);
        for (int r = 0; r < R; ++r) {
            const __m512 sc = q4 ? _mm512_mul_ps(s[r], e) : e;
            acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, c[r], xv)), sc, acc[m][r]);
        }
    }
}

// R weight rows from n against M activation rows (compile-time constants where called), int4 codes
// (q4 = 1) or int8 ones: out[m][r] gets the block sums times both scales, before offsets or row scales.
QL_INLINE void ql_rows(const int8_t *q, const float *dxe, const uint8_t *w, const uint16_t *d, int q4, int M,
                       int R, int64_t n, int K, float out[2][4]) {
    const int np = K / 64, nb = K / 32;
    const int64_t row_bytes = q4 ? K / 2 : K;
    __m512 acc[2][4];
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512i c0[4], c1[4];
    __m512 s0[4], s1[4];
    int p = 0;
    // int4: two pairs of blocks from one 64-byte load; int8: a pair a 64-byte load
    for (; p + 1 < np; p += 2) {
        for (int r = 0; r < R; ++r) {
            const uint8_t *wr = w + (n + r) * row_bytes;
            if (q4) {
                const __m512i raw = _mm512_loadu_si512((const void *)(wr + 32 * p));
                c0[r] = _mm512_and_si512(raw, lo4);
                c1[r] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
                const __m128 dv = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + (n + r) * nb + 2 * p)));
                s0[r] = ql_spread(dv, 0);
                s1[r] = ql_spread(dv, 2);
            } else {
                c0[r] = _mm512_loadu_si512((const void *)(wr + 64 * p));
                c1[r] = _mm512_loadu_si512((const void *)(wr + 64 * p + 64));
            }
        }
        ql_pair(acc, c0, s0, q, dxe, q4, M, R, K, p);
        ql_pair(acc, c1, s1, q, dxe, q4, M, R, K, p + 1);
    }
    if (p < np) {
        // an odd last pair: int4 from 32 bytes
        for (int r = 0; r < R; ++r) {
            const uint8_t *wr = w + (n + r) * row_bytes;
            if (q4) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wr + 32 * p));
                const __m256i l4 = _mm256_set1_epi8(0x0F);
                c0[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, l4)),
                                           _mm256_and_si256(_mm256_srli_epi16(raw, 4), l4), 1);
                int32_t two;
                memcpy(&two, d + (n + r) * nb + 2 * p, sizeof two);
                s0[r] = ql_spread(_mm_cvtph_ps(_mm_cvtsi32_si128(two)), 0);
            } else {
                c0[r] = _mm512_loadu_si512((const void *)(wr + 64 * p));
            }
        }
        ql_pair(acc, c0, s0, q, dxe, q4, M, R, K, p);
    }
    for (int m = 0; m < M; ++m) {
        if (R == 4) {
            _mm_storeu_ps(out[m], ql_sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        } else {
            for (int r = 0; r < R; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
        }
    }
}

// the sums over blocks of offset * sx, for four weight rows and one activation row
QL_INLINE __m128 ql_offsets4(const uint16_t *off, const float *sx, int nb) {
    __m512 a[4];
    for (int r = 0; r < 4; ++r) a[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        const __m512 sv = _mm512_maskz_loadu_ps(k, sx + b);
        for (int r = 0; r < 4; ++r)
            a[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, off + (int64_t)r * nb + b)), sv, a[r]);
    }
    return ql_sum4(a[0], a[1], a[2], a[3]);
}

// R output columns from n for M rows: the int4 sums plus their offsets, or the int8 sums times the scale
QL_INLINE void ql_tile(const int8_t *q, const float *sx, const float *dxe, const uint8_t *w, const uint16_t *d,
                       const uint16_t *off, const float *scale, const float *shift, int q4, int M, int R,
                       int64_t n, int N, int K, void *y, int y_kind) {
    float out[2][4];
    const int nb = K / 32;
    ql_rows(q, dxe, w, d, q4, M, R, n, K, out);
    for (int m = 0; m < M; ++m) {
        float o[4] = {0, 0, 0, 0};
        if (q4 && R == 4) {
            _mm_storeu_ps(o, ql_offsets4(off + n * nb, sx + (int64_t)m * nb, nb));
        } else if (q4) {
            for (int r = 0; r < R; ++r)
                for (int b = 0; b < nb; ++b) o[r] += _cvtsh_ss(off[(n + r) * nb + b]) * sx[(int64_t)m * nb + b];
        }
        for (int r = 0; r < R; ++r) {
            // int8 weights were stored plus 128: their sums carry 128 times each block's codes and scale
            const float v = q4 ? out[m][r] + o[r] : scale[n + r] * (out[m][r] - 128.0f * shift[m]);
            ql_store(y, y_kind, (int64_t)m * N + n + r, v);
        }
    }
}

// A constant M and R per call lets the compiler keep the accumulators in registers. Four weight rows a
// tile, against the activation rows two at a time: with more the registers spill (measured 2x slower at
// four), while the weight rows, just read, stay in the L1 cache for the next two; so each weight is read
// from memory once whatever M.
#define QL_TILE(Q4, M0, MM, R)                                                                                 \
    ql_tile(q + (int64_t)(M0) * K, sx + (int64_t)(M0) * (K / 32), dxe + (int64_t)(M0) * (K / 64) * 16, w, d,  \
            off, scale, shift + (M0), Q4, MM, R, n, N, K, (char *)y + (int64_t)(M0) * N * (y_kind ? 2 : 4),     \
            y_kind)
#define QL_TILES(Q4, R)                                                                                        \
    for (int m0 = 0; m0 < M; m0 += 2) {                                                                        \
        if (m0 + 1 < M)                                                                                        \
            QL_TILE(Q4, m0, 2, R);                                                                             \
        else                                                                                                   \
            QL_TILE(Q4, m0, 1, R);                                                                             \
    }

// Tiles read ahead of the one computed. A layer's weights come from memory (a step reads them all once,
// more than the caches hold); the hardware's prefetcher alone reached ~15 GB/s of the ~40 one core reads.
#define QL_PREFETCH_TILES 8

QL_INLINE void ql_prefetch(const uint8_t *w, const uint16_t *d, const uint16_t *off, int q4, int64_t n, int N, int K) {
    if (n + 4 > N) return;
    const int64_t row_bytes = q4 ? K / 2 : K;
    const char *a = (const char *)(w + n * row_bytes);
    for (int64_t i = 0; i < 4 * row_bytes; i += 64) _mm_prefetch(a + i, _MM_HINT_T0);
    if (q4) {
        const int64_t sb = (int64_t)4 * (K / 32) * 2;  // the four rows' scales (and offsets), in bytes
        for (int64_t i = 0; i < sb; i += 64) {
            _mm_prefetch((const char *)(d + n * (K / 32)) + i, _MM_HINT_T0);
            _mm_prefetch((const char *)(off + n * (K / 32)) + i, _MM_HINT_T0);
        }
    }
}

// shift: [M] the sums of sx over each row's blocks (the int8 weights' correction)
static void ql_matmul(const int8_t *q, const float *sx, const float *dxe, const float *shift, const uint8_t *w,
                      const uint16_t *d, const uint16_t *off, const float *scale, int q4, int M, int N, int K,
                      void *y, int y_kind, int num_threads) {
    const int64_t tiles = N / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n = 4 * t;
        ql_prefetch(w, d, off, q4, n + 4 * QL_PREFETCH_TILES, N, K);
        if (q4) {
            QL_TILES(1, 4)
        } else {
            QL_TILES(0, 4)
        }
    }
    for (int64_t n = 4 * tiles; n < N; ++n) {
        if (q4) {
            QL_TILES(1, 1)
        } else {
            QL_TILES(0, 1)
        }
    }
}
#else
// the code of value k of an int4 weight row in the chunk layout above
static inline int ql_code(const uint8_t *row, int k, int K) {
    const int chunk = k / 128 * 128, size = K - chunk >= 128 ? 128 : 64, t = k - chunk;
    const uint8_t byte = row[chunk / 2 + t % (size / 2)];
    return t < size / 2 ? byte & 15 : byte >> 4;
}

static void ql_matmul_plain(const int8_t *q, const float *dx, const float *sx, const uint8_t *w,
                            const uint16_t *d, const uint16_t *off, const float *scale, int q4, int M, int N, int K,
                            void *y, int y_kind, int num_threads) {
    const int nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int n = 0; n < N; ++n)
        for (int m = 0; m < M; ++m) {
            const int8_t *qm = q + (int64_t)m * K;
            float v = 0.0f;
            for (int b = 0; b < nb; ++b) {
                int sum = 0;
                for (int j = 0; j < 32; ++j) {
                    const int k = 32 * b + j;
                    const int code = q4 ? ql_code(w + (int64_t)n * (K / 2), k, K) : (int)w[(int64_t)n * K + k] - 128;
                    sum += code * qm[k];
                }
                const int64_t i = (int64_t)m * nb + b;
                v += q4 ? ql_h2f(d[(int64_t)n * nb + b]) * dx[i] * (float)sum + ql_h2f(off[(int64_t)n * nb + b]) * sx[i]
                        : dx[i] * (float)sum;
            }
            ql_store(y, y_kind, (int64_t)m * N + n, q4 ? v : scale[n] * v);
        }
}
#endif

// the rounded activations of the calling thread, kept from call to call (a decode step makes a hundred)
static __thread void *ql_scratch;
static __thread size_t ql_scratch_size;

static int ql_run(const void *x, int x_kind, int64_t ld, int M, int K, const uint8_t *w, const uint16_t *d,
                  const uint16_t *off, const float *scale, int q4, int N, void *y, int y_kind, int num_threads) {
    if (M < 1 || K < 64 || K % 64) return -1;
    const size_t floats = (size_t)M * K / 32 * 2 + (size_t)M * K / 64 * 16 + (size_t)M;
    const size_t need = sizeof(float) * floats + (size_t)M * K;
    if (need > ql_scratch_size) {
        free(ql_scratch);
        ql_scratch = aligned_alloc(64, (need + 63) / 64 * 64);
        ql_scratch_size = ql_scratch ? need : 0;
        if (!ql_scratch) return -2;
    }
    float *dx = (float *)ql_scratch, *sx = dx + (size_t)M * K / 32, *dxe = sx + (size_t)M * K / 32;
    float *shift = dxe + (size_t)M * K / 64 * 16;
    int8_t *q = (int8_t *)(shift + M);
#if QL_VNNI
    // the first tiles' weights are on their way while the activations are rounded
    for (int64_t t = 0; t < QL_PREFETCH_TILES; ++t) ql_prefetch(w, d, off, q4, 4 * t, N, K);
#endif
    quantize_q8_blocks(x, x_kind, ld, q, dx, sx, dxe, M, K, num_threads);
#if QL_VNNI
    for (int m = 0; m < M; ++m) {
        shift[m] = 0.0f;
        for (int b = 0; b < K / 32; ++b) shift[m] += sx[(int64_t)m * (K / 32) + b];
    }
    ql_matmul(q, sx, dxe, shift, w, d, off, scale, q4, M, N, K, y, y_kind, num_threads);
#else
    ql_matmul_plain(q, dx, sx, w, d, off, scale, q4, M, N, K, y, y_kind, num_threads);
#endif
    return 0;
}

// x: [M, K] float32 (x_kind 0) or bf16 (1), rows ld apart, K % 64 == 0; qs: [N, K/2] codes in the
// chunk layout; d, off: [N, K/32] float16 (w = code * d + off); y: [M, N] float32 (y_kind 0) or bf16 (1).
// Returns 0, or -1 for shapes it does not take, -2 where memory ran out.
int linear_q4(const void *x, int x_kind, int64_t ld, int M, int K, const uint8_t *qs, const uint16_t *d,
              const uint16_t *off, int N, void *y, int y_kind, int num_threads) {
    return ql_run(x, x_kind, ld, M, K, qs, d, off, NULL, 1, N, y, y_kind, num_threads);
}

// As linear_q4 for w: [N, K] int8 codes plus 128 and scale: [N] float32 (w = (stored - 128) * scale).
int linear_i8(const void *x, int x_kind, int64_t ld, int M, int K, const uint8_t *w, const float *scale, int N,
              void *y, int y_kind, int num_threads) {
    return ql_run(x, x_kind, ld, M, K, w, NULL, NULL, scale, 0, N, y, y_kind, num_threads);
}
