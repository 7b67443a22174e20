// The C kernels one file calls from another (layer.c runs the others back to back); each defining file
// includes this too, so a signature that drifts is a compile error, not a wrong call.
#pragma once
#include <stdint.h>

void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *y, uint16_t *res_out, const uint16_t *w,
                   int64_t rows, int n, int64_t x_stride, float eps, int num_threads);
void rotary_bf16(uint16_t *q, uint16_t *k, const int64_t *positions, const float *cos_sin, int64_t T, int Hq, int Hk,
                 int D, int64_t q_stride, int64_t k_stride, int num_threads);
int decode_attention(const void *q, int q_kind, int64_t q_stride, const void *k, const void *v, int kv_kind,
                     const int32_t *page_table, int64_t pt_stride, const int64_t *rows, const int64_t *lens, float *out,
                     int B, int Hq, int Hk, int D, float scale, int num_threads);
int linear_q4(const void *x, int x_kind, int64_t ld, int M, int K, const uint8_t *qs, const uint16_t *d,
              const uint16_t *off, int N, void *y, int y_kind, int num_threads);
int linear_i8(const void *x, int x_kind, int64_t ld, int M, int K, const uint8_t *w, const float *scale, int N,
              void *y, int y_kind, int num_threads);
