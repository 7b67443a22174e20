// A bf16 decode step of a Llama-shaped model's layers in one call: norm, q|k|v, rotary, K/V store,
// paged attention, o, norm, gate|up, SiLU * up, down, for every layer.
//
// At one to four rows the arithmetic of a layer is a few tens of microseconds; driven from Python its
// dozen ops cost as much again in dispatch (module calls, wrappers, ctypes). Here the same C kernels
// the Python path calls run back to back (elementwise.c, attention.c, qlinear.c), rounding to bf16 where
// that path rounds, so the two decode the same tokens (up to the float32 order of SiLU's exp).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

// a packed weight [N, K]: kind 4 (int4: w, d, off) or 8 (int8: w, scale)
typedef struct {
    int kind, N, K;
    const uint8_t *w;
    const uint16_t *d, *off;
    const float *scale;
} ql_weight;

typedef struct {
    const uint16_t *in_norm, *post_norm;  // [H] bf16
    ql_weight qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;  // [slots, Hk, D] bf16: this layer's part of the pool
} ql_layer;

typedef struct {
    int num_layers, H, I, Hq, Hk, D;
    float eps, attn_scale;
    const float *cos_sin;  // [max_positions, 2D] float32
    const int32_t *page_table;
    int64_t pt_stride;
} ql_model;

static int ql_linear(const ql_weight *w, const uint16_t *x, uint16_t *y, int M, int threads) {
    if (w->kind == 4) return linear_q4(x, 1, w->K, M, w->K, w->w, w->d, w->off, w->N, y, 1, threads);
    return linear_i8(x, 1, w->K, M, w->K, w->w, w->scale, w->N, y, 1, threads);
}

// x: [M, H] bf16 the embeddings, overwritten with the last layer's output; residual: [M, H] bf16 written
// (the residual stream after the last layer), so the final norm is norm(x + residual). positions,
// out_loc (each row's new K/V slot), rows (page-table row), lens (context after this step): [M] int64.
// Returns 0, or the first failing kernel's code (-1: a shape it does not take, -2: out of memory).
int decode_layers(const ql_model *model, const ql_layer *layers, uint16_t *x, uint16_t *residual,
                  const int64_t *positions, const int64_t *out_loc, const int64_t *rows, const int64_t *lens, int M,
                  int threads) {
    const int H = model->H, I = model->I, Hq = model->Hq, Hk = model->Hk, D = model->D;
    const int nqkv = (Hq + 2 * Hk) * D;
    // bf16 scratch: the norm's output, q|k|v, the attention's output, gate|up, SiLU * up; float32: its output
    const size_t halves = (size_t)M * (H + nqkv + Hq * D + 2 * I + I);
    const size_t floats = (size_t)M * Hq * D;
    char *scratch = malloc(halves * 2 + floats * 4 + 64);
    if (!scratch) return -2;
    float *attn = (float *)scratch;
    uint16_t *h = (uint16_t *)(attn + (size_t)M * Hq * D), *qkv = h + (size_t)M * H;
    uint16_t *attn_h = qkv + (size_t)M * nqkv, *gu = attn_h + (size_t)M * Hq * D, *act = gu + (size_t)M * 2 * I;
    int rc = 0;
    for (int l = 0; l < model->num_layers && !rc; ++l) {
        const ql_layer *L = layers + l;
        // the first layer has no residual yet: the stream starts as the embeddings
        if (l == 0) memcpy(residual, x, sizeof(uint16_t) * M * H);
        rms_norm_bf16(x, l == 0 ? NULL : residual, h, residual, L->in_norm, M, H, H, model->eps, threads);
        if ((rc = ql_linear(&L->qkv, h, qkv, M, threads))) break;
        uint16_t *q = qkv, *k = qkv + Hq * D, *v = k + Hk * D;
        rotary_bf16(q, k, positions, model->cos_sin, M, Hq, Hk, D, nqkv, nqkv, threads);
        for (int m = 0; m < M; ++m) {
            memcpy(L->k_cache + out_loc[m] * Hk * D, k + (size_t)m * nqkv, sizeof(uint16_t) * Hk * D);
            memcpy(L->v_cache + out_loc[m] * Hk * D, v + (size_t)m * nqkv, sizeof(uint16_t) * Hk * D);
        }
        if ((rc = decode_attention(q, 1, nqkv, L->k_cache, L->v_cache, 1, model->page_table, model->pt_stride, rows,
                                   lens, attn, M, Hq, Hk, D, model->attn_scale, threads)))
            break;
        for (size_t i = 0; i < (size_t)M * Hq * D; ++i) attn_h[i] = f2bf(attn[i]);
        if ((rc = ql_linear(&L->o, attn_h, x, M, threads))) break;
        rms_norm_bf16(x, residual, h, residual, L->post_norm, M, H, H, model->eps, threads);
        if ((rc = ql_linear(&L->gate_up, h, gu, M, threads))) break;
        for (int m = 0; m < M; ++m) {
            const uint16_t *g = gu + (size_t)m * 2 * I, *u = g + I;
            uint16_t *a = act + (size_t)m * I;
            for (int i = 0; i < I; ++i) {
                // torch's bf16 SiLU rounds once, then the product rounds again
                const float gf = bf2f(g[i]);
                a[i] = f2bf(bf2f(f2bf(gf / (1.0f + expf(-gf)))) * bf2f(u[i]));
            }
        }
        rc = ql_linear(&L->down, act, x, M, threads);
    }
    free(scratch);
    return rc;
}
