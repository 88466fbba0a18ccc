"""One whole decode step of a llama-family model with quantized weights, as one native call.

A batch-1 decode step is ~120 small products; called one by one from Python, each pays the call,
the tensor allocations and an OpenMP fork and join, which together cost more than the products on a
small model. Here the threads enter one parallel region per step: each keeps its own copy of the
residual stream (so norms and activation quantization need no hand-off) and the products are split
by output rows, with a barrier only where every row of a result is read next (five per layer).

The model is described once, at load, by a plan: int64 words (pointers and sizes) laid out as
``PLAN_HEADER`` then ``LAYER_WORDS`` per layer; see ``plan_words`` in ``models/native_decode.py``.
"""

from __future__ import annotations

PLAN_HEADER = 8  # num_layers, H, Hkv, D, hidden, inter, final_norm, reserved
LINEAR_WORDS = 7  # format (4 or 8), data, scale, min, bias, rows N, cols K
LAYER_WORDS = 4 * LINEAR_WORDS + 9  # qkv, o, gate_up, down; norms, caches, rope tables, window

SOURCE = r"""
#include <omp.h>

typedef struct { int64_t fmt, w, scale, min, bias, N, K; } lin_t;
typedef struct {
    lin_t qkv, o, gate_up, down;
    int64_t input_norm, post_norm, q_norm, k_norm, k_cache, v_cache, cos, sin, window;
} layer_t;
typedef struct { int64_t L, H, Hkv, D, hidden, inter, final_norm, reserved; } head_t;

/* A thread's activations for the int4 products: rows quantized per block of 32. */
typedef struct { int16_t *qx; float *dx, *sx; } qact_t;

static void split(int64_t n, int64_t unit, int64_t *lo, int64_t *hi) {
    int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    int64_t units = (n + unit - 1) / unit, per = units / nth, extra = units % nth;
    int64_t a = tid * per + (tid < extra ? tid : extra), b = a + per + (tid < extra ? 1 : 0);
    *lo = a * unit < n ? a * unit : n;
    *hi = b * unit < n ? b * unit : n;
}

static void quantize_rows(const float *x, int64_t B, int64_t K, qact_t *q) {
    for (int64_t m = 0; m < B; m++)
        quantize_row_q16(x + m * K, K, q->qx + m * K, q->dx + m * (K / 32), q->sx + m * (K / 32));
}

/* y[m, n] for n in [lo, hi) of one product; x float rows [B, K] (int8) or their quantized copy (int4). */
static void linear_rows(const lin_t *l, const float *x, const qact_t *q, int64_t B, float *y, int64_t ldy,
                        int64_t lo, int64_t hi) {
    int64_t K = l->K, N = l->N;
    const float *bias = (const float *)l->bias;
    if (l->fmt == 4) {
        int64_t G = K / 32;
        const uint8_t *w = (const uint8_t *)l->w;
        const uint16_t *scale = (const uint16_t *)l->scale, *mins = (const uint16_t *)l->min;
        for (int64_t n = lo; n < hi; n++) {
            const uint8_t *wr = w + n * (K / 2);
            int4_prefetch(wr, K);
            for (int64_t m0 = 0; m0 < B; m0 += 4) {
                int R = (int)(B - m0 < 4 ? B - m0 : 4);
                float out[4];
                int4_rows(wr, scale + n * G, mins + n * G, G, q->qx + m0 * K, q->dx + m0 * G, q->sx + m0 * G, K,
                          R, out);
                for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = out[r] + (bias ? bias[n] : 0.0f);
            }
        }
        return;
    }
    const int8_t *w = (const int8_t *)l->w;
    const float *scale = (const float *)l->scale;
    for (int64_t n0 = lo; n0 < hi; n0 += 4) {
        for (int64_t m0 = 0; m0 < B; m0 += 4) {
            int R = (int)(B - m0 < 4 ? B - m0 : 4);
            float acc[16];
            if (n0 + 4 <= hi) {
                int64_t ahead = n0 + 20 <= N ? n0 + 16 : n0;
                dot4(x + m0 * K, K, R, w + n0 * K, w + ahead * K, K, acc);
            } else {
                for (int r = 0; r < R; r++)
                    for (int64_t n = n0; n < hi; n++)
                        acc[r * 4 + n - n0] = dot_scalar(x + (m0 + r) * K, w + n * K, 0, K);
            }
            for (int r = 0; r < R; r++)
                for (int64_t n = n0; n < n0 + 4 && n < hi; n++)
                    y[(m0 + r) * ldy + n] = acc[r * 4 + n - n0] * scale[n] + (bias ? bias[n] : 0.0f);
        }
    }
}

static void norm_rows(const float *x, const float *w, float *out, int64_t B, int64_t dim, float eps) {
    for (int64_t m = 0; m < B; m++) {
        const float *xr = x + m * dim;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[m * dim + i] = xr[i] * inv * w[i];
    }
}

static void add_rows(float *x, const float *d, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] += d[i];
}

/* x_in: [B, hidden] embedded tokens; out: [B, hidden] final-normed hidden states. */
void llama_decode_step(const int64_t *plan, const float *x_in, int64_t B, const int64_t *positions,
                       const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                       int64_t block_size, float eps, float attn_scale, float *out) {
    const head_t *hd = (const head_t *)plan;
    const layer_t *layers = (const layer_t *)(plan + 8);
    int64_t H = hd->H, Hkv = hd->Hkv, D = hd->D, hidden = hd->hidden, inter = hd->inter;
    int64_t width = (H + 2 * Hkv) * D, max_ctx = 1;
    for (int64_t b = 0; b < B; b++) max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
    int64_t wide = hidden > H * D ? hidden : H * D;
    wide = wide > inter ? wide : inter;
    /* shared results: qkv, attention output, o / down output, activation */
    float *qkv = (float *)malloc(sizeof(float) * B * (width + H * D + hidden + inter));
    float *attn = qkv + B * width, *delta = attn + B * H * D, *act = delta + B * hidden;
    #pragma omp parallel
    {
        float *x = (float *)malloc(sizeof(float) * (B * hidden + B * wide + max_ctx + B * wide / 16 + 2 * B * inter));
        float *h = x + B * hidden, *scores = h + B * wide, *g = scores + max_ctx + B * wide / 16;
        qact_t q = {(int16_t *)malloc(sizeof(int16_t) * B * wide), scores + max_ctx, scores + max_ctx + B * wide / 32};
        memcpy(x, x_in, sizeof(float) * B * hidden);
        int64_t lo, hi;
        for (int64_t i = 0; i < hd->L; i++) {
            const layer_t *ly = &layers[i];
            if (i > 0) add_rows(x, delta, B * hidden);
            norm_rows(x, (const float *)ly->input_norm, h, B, hidden, eps);
            if (ly->qkv.fmt == 4) quantize_rows(h, B, hidden, &q);
            /* qkv by heads; each head is rotated (and normed) by the thread that computed it */
            split(H + 2 * Hkv, 1, &lo, &hi);
            linear_rows(&ly->qkv, h, &q, B, qkv, width, lo * D, hi * D);
            for (int64_t b = 0; b < B; b++) {
                const float *cos = (const float *)ly->cos + positions[b] * D, *sin = (const float *)ly->sin + positions[b] * D;
                for (int64_t head = lo; head < hi; head++) {
                    float *v = qkv + b * width + head * D;
                    if (head < H) {
                        head_norm_rope(v, (const float *)ly->q_norm, cos, sin, D, eps);
                    } else if (head < H + Hkv) {
                        head_norm_rope(v, (const float *)ly->k_norm, cos, sin, D, eps);
                        memcpy((float *)ly->k_cache + (slots[b] * Hkv + head - H) * D, v, sizeof(float) * D);
                    } else {
                        memcpy((float *)ly->v_cache + (slots[b] * Hkv + head - H - Hkv) * D, v, sizeof(float) * D);
                    }
                }
            }
            #pragma omp barrier
            split(B * H, 1, &lo, &hi);
            for (int64_t p = lo; p < hi; p++) {
                int64_t b = p / H, head = p % H;
                attend_head(qkv + b * width + head * D, (const float *)ly->k_cache, (const float *)ly->v_cache,
                            tables + b * max_blocks, context_lens[b], ly->window, Hkv, head / (H / Hkv), D,
                            block_size, attn_scale, scores, attn + (b * H + head) * D);
            }
            #pragma omp barrier
            if (ly->o.fmt == 4) quantize_rows(attn, B, H * D, &q);
            split(hidden, 4, &lo, &hi);
            linear_rows(&ly->o, attn, &q, B, delta, hidden, lo, hi);
            #pragma omp barrier
            add_rows(x, delta, B * hidden);
            norm_rows(x, (const float *)ly->post_norm, h, B, hidden, eps);
            if (ly->gate_up.fmt == 4) quantize_rows(h, B, hidden, &q);
            /* gate rows [lo, hi) and the matching up rows: this thread owns those activations */
            split(inter, 4, &lo, &hi);
            linear_rows(&ly->gate_up, h, &q, B, g, 2 * inter, lo, hi);
            linear_rows(&ly->gate_up, h, &q, B, g, 2 * inter, inter + lo, inter + hi);
            for (int64_t m = 0; m < B; m++)
                for (int64_t j = lo; j < hi; j++) {
                    float a = g[m * 2 * inter + j], u = g[m * 2 * inter + inter + j];
                    act[m * inter + j] = a / (1.0f + expf(-a)) * u;
                }
            #pragma omp barrier
            if (ly->down.fmt == 4) quantize_rows(act, B, inter, &q);
            split(hidden, 4, &lo, &hi);
            linear_rows(&ly->down, act, &q, B, delta, hidden, lo, hi);
            #pragma omp barrier
        }
        add_rows(x, delta, B * hidden);
        #pragma omp master
        norm_rows(x, (const float *)hd->final_norm, out, B, hidden, eps);
        free(q.qx);
        free(x);
    }
    free(qkv);
}
"""
