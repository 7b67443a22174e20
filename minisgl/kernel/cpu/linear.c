// y = x w^T for a few rows of x against bf16 weights: the decode step of one or a few requests.
//
// oneDNN's bf16 matmul on a CPU without AMX is slow for so few rows (a 960x576 layer takes twice
// as long as in float32). This kernel reads each weight row once for all rows of x, widening bf16
// to float32 in registers, so its speed is set by memory bandwidth. Float32 accumulation, as oneDNN.
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f widen(const uint16_t *p) {
    v16u u = __builtin_convertvector(*(const v16h *)p, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(v16f x) {
    v16f y = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    y += __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    y += __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return y[0] + y[1];
}

#define MAX_ROWS 8

// x: [M, K] float32, w: [N, K] bf16, y: [M, N] float32; M <= MAX_ROWS, K a multiple of 16.
void linear_bf16(const float *x, const uint16_t *w, float *y, int M, int N, int K, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; ++n) {
        const uint16_t *wn = w + (int64_t)n * K;
        v16f acc[MAX_ROWS];
        for (int m = 0; m < M; ++m) acc[m] = (v16f){0};
        for (int c = 0; c < K; c += 16) {
            const v16f wv = widen(wn + c);
            for (int m = 0; m < M; ++m) acc[m] += *(const v16f *)(x + (int64_t)m * K + c) * wv;
        }
        for (int m = 0; m < M; ++m) y[(int64_t)m * N + n] = hsum(acc[m]);
    }
}
