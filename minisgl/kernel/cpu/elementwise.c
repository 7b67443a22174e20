// The small per-layer ops of a bf16 decode step, each one pass instead of five to ten torch launches.
//
// At one or a few rows these ops cost more in dispatch than in arithmetic. Each kernel rounds to
// bf16 exactly where the torch version (layers/norm.py, rotary.py) rounds, so the two paths agree:
// bit for bit for rotary, up to the order of a float32 sum for the norm. (silu * up stays torch's:
// one launch each, with a vectorised exp that a scalar loop here loses to, measured.)
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// round to nearest even, as torch converts float32 to bf16; a NaN stays a (quiet) NaN
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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
