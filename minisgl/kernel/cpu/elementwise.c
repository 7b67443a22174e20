// The small per-layer ops of a bf16 decode step, each one pass instead of five to ten torch launches.
//
// At one or a few rows these ops cost more in dispatch than in arithmetic. Each kernel rounds to
// bf16 exactly where the torch version (layers/norm.py, rotary.py, activation.py) rounds, so the two
// paths agree: bit for bit for rotary, up to the order of a float32 sum for the norm, up to the last bits
// of an exp for silu * up.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

static inline float rnd(float f) { return bf2f(f2bf(f)); }

// y = w * bf16(v * rsqrt(mean(v^2) + eps)) per row, with v = bf16(x + residual) written to res_out
// where residual is given. x rows are x_stride apart; y, residual and res_out are [rows, n].
void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *y, uint16_t *res_out,
                   const uint16_t *w, int64_t rows, int n, int64_t x_stride, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *yr = y + r * n;
        float ss = 0.0f;
        if (residual) {
            const uint16_t *rr = residual + r * n;
            uint16_t *ro = res_out + r * n;
            for (int i = 0; i < n; ++i) {
                uint16_t v = f2bf(bf2f(xr[i]) + bf2f(rr[i]));
                ro[i] = v;
                const float f = bf2f(v);
                ss += f * f;
            }
            xr = ro;
        } else {
            for (int i = 0; i < n; ++i) {
                const float f = bf2f(xr[i]);
                ss += f * f;
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; ++i) yr[i] = f2bf(bf2f(w[i]) * rnd(bf2f(xr[i]) * inv));
    }
}

static inline void rotate_head(uint16_t *x, const float *cos, const float *sin, int half) {
    for (int j = 0; j < half; ++j) {
        const float a = bf2f(x[j]), b = bf2f(x[j + half]);
        const float c1 = rnd(cos[j]), c2 = rnd(cos[j + half]);
        const float s1 = rnd(sin[j]), s2 = rnd(sin[j + half]);
        // x * cos + rotate_half(x) * sin, each product rounded to bf16 as the torch version's are
        x[j] = f2bf(rnd(a * c1) + rnd(-b * s1));
        x[j + half] = f2bf(rnd(b * c2) + rnd(a * s2));
    }
}

// In place: q [T, Hq, D] and k [T, Hk, D] (token rows q_stride / k_stride apart, heads D apart);
// cos_sin [max_pos, 2D] float32 holds [cos | sin] of each position.
void rotary_bf16(uint16_t *q, uint16_t *k, const int64_t *positions, const float *cos_sin, int64_t T, int Hq,
                 int Hk, int D, int64_t q_stride, int64_t k_stride, int num_threads) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int64_t t = 0; t < T; ++t) {
        const float *cos = cos_sin + positions[t] * 2 * D;
        const float *sin = cos + D;
        for (int h = 0; h < Hq; ++h) rotate_head(q + t * q_stride + (int64_t)h * D, cos, sin, half);
        for (int h = 0; h < Hk; ++h) rotate_head(k + t * k_stride + (int64_t)h * D, cos, sin, half);
    }
}

// The two ends of a W8A8 matmul (int8 activations times int8 weights, int32 sums, layers/quant.py):
// quantize each row of x to int8 with its own scale, and turn the int32 sums back into floats. In
// torch ops each end is four to six launches, about 10 us at one row against 9 us for the integer
// matmul itself (measured, SmolLM2's 576 x 1536 layer); here each is one pass.

// x: [M, K] float32 (x_kind 0) or bf16 (x_kind 1), rows ld elements apart; col_mul: [K] float32 or NULL;
// q: [M, K] int8; scale: [M] float32 with x[m, k] * col_mul[k] ~ q[m, k] * scale[m]. Symmetric, codes in
// [-127, 127], the row's largest magnitude mapped to 127; rounding half to even (torch.round's). With
// as_uint8, q holds code + 128 as uint8.
// col_mul is W8A8's smoothing (minisgl/models/smoothing.py): one float32 product an element, as torch's.
void quantize_rows_int8(const void *x, int x_kind, int64_t ld, const float *col_mul, int8_t *q, float *scale,
                        int M, int K, int as_uint8, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M > 1)
    for (int m = 0; m < M; ++m) {
        // a float and its bits: the largest magnitude is found as the largest integer of the bits without
        // their sign (the same order for non-negative floats), which vectorises; a float compare chain
        // did not (35 us for 64 rows of 576, measured, against 12)
        union {
            float f;
            uint32_t u;
        } row[K];
        if (x_kind == 1) {
            const uint16_t *xm = (const uint16_t *)x + (int64_t)m * ld;
            for (int k = 0; k < K; ++k) row[k].f = bf2f(xm[k]);
        } else {
            const float *xm = (const float *)x + (int64_t)m * ld;
            for (int k = 0; k < K; ++k) row[k].f = xm[k];
        }
        if (col_mul != NULL) {
            for (int k = 0; k < K; ++k) row[k].f *= col_mul[k];
        }
        uint32_t bits = 0;
        for (int k = 0; k < K; ++k) {
            const uint32_t a = row[k].u & 0x7fffffffu;
            bits = a > bits ? a : bits;
        }
        union {
            uint32_t u;
            float f;
        } peak = {bits};
        const float amax = peak.f;
        const float s = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
        int8_t *qm = q + (int64_t)m * K;
        for (int k = 0; k < K; ++k) {
            // rintf rounds half to even in the default mode and compiles to one instruction
            const float r = rintf(row[k].f / s);
            qm[k] = (int8_t)(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
        }
        if (as_uint8) {
            // the code + 128 as uint8 (oneDNN's prepacked int8 matmul takes unsigned activations with a zero point)
            uint8_t *um = (uint8_t *)qm;
            for (int k = 0; k < K; ++k) um[k] = (uint8_t)(qm[k] + 128);
        }
        scale[m] = s;
    }
}

// acc: [M, N] int32 (acc_kind 0), or float32 holding int32 sums (acc_kind 1: oneDNN's int8 matmul writes
// them so, exactly) -> y: [M, N] float32 (y_kind 0) or bf16 (y_kind 1), y = acc * (row_scale[m] *
// col_scale[n]), the two scales multiplied first (as the torch path does).
// Without -fassociative-math: torch's order of the products is what the tests hold these bits to.
__attribute__((optimize("no-associative-math"))) void rescale_int32(const void *acc, int acc_kind, const float *row_scale, const float *col_scale, void *y,
                   int y_kind, int M, int N, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M > 1)
    for (int m = 0; m < M; ++m) {
        const float rs = row_scale[m];
        float *ym32 = (float *)y + (int64_t)m * N;
        uint16_t *ym16 = (uint16_t *)y + (int64_t)m * N;
        if (acc_kind == 1) {
            const float *am = (const float *)acc + (int64_t)m * N;
            if (y_kind == 1) {
                for (int n = 0; n < N; ++n) ym16[n] = f2bf(am[n] * (rs * col_scale[n]));
            } else {
                for (int n = 0; n < N; ++n) ym32[n] = am[n] * (rs * col_scale[n]);
            }
        } else {
            const int32_t *am = (const int32_t *)acc + (int64_t)m * N;
            if (y_kind == 1) {
                for (int n = 0; n < N; ++n) ym16[n] = f2bf((float)am[n] * (rs * col_scale[n]));
            } else {
                for (int n = 0; n < N; ++n) ym32[n] = (float)am[n] * (rs * col_scale[n]);
            }
        }
    }
}

// The greedy sample: the index of each row's largest value, as torch.argmax picks it (the first of equal
// maxima; a NaN counts as the largest, the first NaN wins). torch's CPU argmax runs about 2 G values/s
// on one thread, 1.65 ms for a 64-row step over SmolLM2's 49,152 logits; sixteen lanes, each keeping
// its own first maximum, are bound by reading the logits instead.
typedef float a16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t a16i __attribute__((vector_size(64)));

// x: [rows, n] float32, rows ld apart -> out: [rows] int32.
void argmax_rows(const float *x, int64_t ld, int64_t rows, int64_t n, int32_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * ld;
        float m = 0.0f;
        int64_t arg = -1, i = 0;
        a16i nan = {0};
        if (n >= 16) {
            a16i lane;
            for (int j = 0; j < 16; ++j) lane[j] = j;
            a16f best = *(const a16f *)xr;
            a16i at = lane, bits;
            nan |= best != best;
            memcpy(&bits, &best, sizeof bits);
            for (i = 16; i + 16 <= n; i += 16) {
                const a16f v = *(const a16f *)(xr + i);
                // strict: a lane keeps its first maximum (NaN compares false: counted apart); the
                // comparison's all-ones lanes select by bits (C has no vector ?:)
                const a16i better = v > best;
                a16i vbits;
                memcpy(&vbits, &v, sizeof vbits);
                bits = (vbits & better) | (bits & ~better);
                memcpy(&best, &bits, sizeof best);
                at = ((lane + (int32_t)i) & better) | (at & ~better);
                nan |= v != v;
            }
            m = best[0], arg = at[0];
            for (int j = 1; j < 16; ++j)
                if (best[j] > m || (best[j] == m && at[j] < arg)) m = best[j], arg = at[j];
        }
        int64_t nan_seen = 0;
        for (int j = 0; j < 16; ++j) nan_seen |= nan[j];
        for (; i < n; ++i) {
            nan_seen |= xr[i] != xr[i];
            if (arg < 0 || xr[i] > m) m = xr[i], arg = i;
        }
        if (nan_seen)
            for (int64_t k = 0; k < n; ++k)
                if (xr[k] != xr[k]) {
                    arg = k;
                    break;
                }
        out[r] = (int32_t)arg;
    }
}

// silu(gate) * up for bf16 rows holding gate|up side by side (x: [rows, 2n], rows x_stride apart; y:
// [rows, n]), rounded as torch's `F.silu(gate) * up` rounds: silu to bf16, then the product to bf16.
// torch computes it in two launches with a vectorised exp; on AVX-512 this is one pass with an exp of
// its own (Cody-Waite reduction by ln 2, a degree-6 polynomial, the power of two by vscalefps: within
// 2 ulp of expf, so the bf16 results are torch's but for a rare tie of the rounding). Elsewhere a scalar
// loop with expf.
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n ln2 in two parts, exact enough for |x| up to the float range
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    // 2^n past the float range gives inf or 0, as expf does; a NaN x stays NaN through r
    return _mm512_scalef_ps(p, n);
}

// float32 -> bf16 rounding to nearest even, NaN kept quiet (f2bf's rule, sixteen at a time)
static inline __m256i f2bf_ps(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline __m512 bf2f_ps(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
#endif

void silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t rows, int n,
                       int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *gate = x + r * x_stride, *up = gate + n;
        uint16_t *out = y + r * n;
        int i = 0;
#if defined(__AVX512F__)
        for (; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            const __m512 g = bf2f_ps(gate + i, k);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m256i act = f2bf_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(act), 16));
            _mm256_mask_storeu_epi16(out + i, k, f2bf_ps(_mm512_mul_ps(a, bf2f_ps(up + i, k))));
        }
#endif
        for (; i < n; ++i) {
            const float g = bf2f(gate[i]);
            out[i] = f2bf(rnd(g / (1.0f + expf(-g))) * bf2f(up[i]));
        }
    }
}
