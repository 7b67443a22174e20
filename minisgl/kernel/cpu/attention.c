// Decode attention for the CPU: each request's one query attends over its context, read in place
// from the paged KV pool through the page table (no gather into a padded batch).
//
// Plain C with OpenMP, called through ctypes: it builds in about a second with gcc and needs no
// torch headers. Work is split over requests; a token's K (and V) row of every head is read once,
// contiguously, and the rows a few tokens ahead are prefetched. Rows are handled as 16-float vectors
// (GCC vector extensions, which the compiler maps to AVX-512, AVX2 or SSE); a head_dim that is not
// a multiple of 16 takes the scalar loop.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
