"""Small native CPU kernels, compiled once per machine with the system C compiler and loaded
with ctypes.

Weight-only int8 matrix-vector products for decode: float32 activations, int8 weights with one
float32 scale per output row. Batch-1 decode on a CPU is bound by the bytes of weights read per
token; int8 reads a quarter of float32's and keeps activations exact (unlike dynamic int8
activation quantization, which visibly degrades small models). The OpenMP runtime is the one
torch already loaded (same soname), so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from trtedge.runtime.ops import cpu_int4, cpu_step

log = logging.getLogger("trtedge")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* The prefetch of a weight row's n bytes at p, a row ahead of the one being summed. With AVX2 on Zen 3:
   8 KiB ahead into L1 (~1.5x the bandwidth of none). On Zen 4 (AVX-512 VNNI, WEIGHT_PREFETCH_FAR): that
   was slower than none, and 64 KiB ahead into L2 only (prefetcht2) faster again (cpu_int4's
   int4_prefetch has the figures; the GGUF rows take none there). Intel CPUs keep the first (the other
   not measured there). */
#if defined(__AVX512VNNI__) && (defined(__znver3__) || defined(__znver4__))  /* Zen 4 (gcc 12: znver3); Zen 5 not measured */
#define WEIGHT_PREFETCH_FAR 1
#else
#define WEIGHT_PREFETCH_FAR 0
#endif
static inline void weight_prefetch(const uint8_t *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64)
#if WEIGHT_PREFETCH_FAR
        __builtin_prefetch(p + 65536 + o, 0, 1);
#else
        __builtin_prefetch(p + 8192 + o, 0, 3);
#endif
}
#if defined(__AVX2__)
static inline float hsum8(__m256 v) {  /* the sum of 8 lanes (the AVX2 kernels here and in cpu_gguf.c) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static float dot_scalar(const float *x, const int8_t *w, int64_t from, int64_t K) {
    float acc = 0.0f;
    #pragma omp simd reduction(+:acc)  /* vectorized where AVX-512 is absent (AVX2) */
    for (int64_t k = from; k < K; k++) acc += x[k] * (float)w[k];
    return acc;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#ifdef __AVX512F__
static inline __m512 widen(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
typedef __m512 vec_t;
#define LANES 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
#else /* AVX2 and FMA: 8 lanes */
static inline __m256 widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
typedef __m256 vec_t;
#define LANES 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSUM(v) hsum8(v)
#endif

/* Four weight rows against R (1..4) activation rows: out[r * 4 + i]. Each widened weight vector
   feeds R FMAs and each activation load feeds four, and 4 * R sums are in flight (one sum a row,
   what a vectorized dot_scalar keeps, waits on its own FMA's latency every step). */
#define DOT4_BODY(R)                                                                    \
    vec_t acc[R][4];                                                                    \
    for (int r = 0; r < R; r++)                                                         \
        for (int i = 0; i < 4; i++) acc[r][i] = VZERO();                                \
    int64_t k = 0;                                                                      \
    for (; k + LANES <= K; k += LANES) {                                                \
        if ((k & 63) == 0)                                                              \
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(pf + i * K + k), _MM_HINT_T0); \
        vec_t w0 = widen(w + k), w1 = widen(w + K + k);                                 \
        vec_t w2 = widen(w + 2 * K + k), w3 = widen(w + 3 * K + k);                     \
        for (int r = 0; r < R; r++) {                                                   \
            vec_t xv = VLOAD(x + r * ldx + k);                                          \
            acc[r][0] = VFMA(xv, w0, acc[r][0]);                                        \
            acc[r][1] = VFMA(xv, w1, acc[r][1]);                                        \
            acc[r][2] = VFMA(xv, w2, acc[r][2]);                                        \
            acc[r][3] = VFMA(xv, w3, acc[r][3]);                                        \
        }                                                                               \
    }                                                                                   \
    for (int r = 0; r < R; r++)                                                         \
        for (int i = 0; i < 4; i++)                                                     \
            out[r * 4 + i] = VSUM(acc[r][i]) + dot_scalar(x + r * ldx, w + i * K, k, K);

static void dot4x1(const float *x, int64_t ldx, const int8_t *w, const int8_t *pf, int64_t K, float *out) { DOT4_BODY(1) }
static void dot4x2(const float *x, int64_t ldx, const int8_t *w, const int8_t *pf, int64_t K, float *out) { DOT4_BODY(2) }
static void dot4x3(const float *x, int64_t ldx, const int8_t *w, const int8_t *pf, int64_t K, float *out) { DOT4_BODY(3) }
static void dot4x4(const float *x, int64_t ldx, const int8_t *w, const int8_t *pf, int64_t K, float *out) { DOT4_BODY(4) }

/* pf: rows a few groups ahead, prefetched while these are summed (doubles the bandwidth reached). */
static void dot4(const float *x, int64_t ldx, int R, const int8_t *w, const int8_t *pf, int64_t K, float *out) {
    switch (R) {
        case 1: dot4x1(x, ldx, w, pf, K, out); break;
        case 2: dot4x2(x, ldx, w, pf, K, out); break;
        case 3: dot4x3(x, ldx, w, pf, K, out); break;
        default: dot4x4(x, ldx, w, pf, K, out); break;
    }
}
#else
static void dot4(const float *x, int64_t ldx, int R, const int8_t *w, const int8_t *pf, int64_t K, float *out) {
    (void)pf;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) out[r * 4 + i] = dot_scalar(x + r * ldx, w + i * K, 0, K);
}
#endif

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n]   (w int8, row-major [N, K]) */
void int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale,
                 const float *bias, float *y, int64_t N) {
    int64_t groups = (N + 3) / 4;
    #pragma omp parallel for schedule(dynamic, 16)  /* a descheduled thread holds up one chunk, not its share */
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * 4;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = (int)(M - m0 < 4 ? M - m0 : 4);
            float acc[16];
            if (n0 + 4 <= N) {
                int64_t ahead = n0 + 16 + 4 <= N ? n0 + 16 : n0;
                dot4(x + m0 * K, K, R, w + n0 * K, w + ahead * K, K, acc);
            } else {
                for (int r = 0; r < R; r++)
                    for (int64_t n = n0; n < N; n++)
                        acc[r * 4 + n - n0] = dot_scalar(x + (m0 + r) * K, w + n * K, 0, K);
            }
            for (int r = 0; r < R; r++)
                for (int64_t n = n0; n < n0 + 4 && n < N; n++)
                    y[(m0 + r) * N + n] = acc[r * 4 + n - n0] * scale[n] + (bias ? bias[n] : 0.0f);
        }
    }
}

/* ---- bfloat16 weights x float32 activations: each activation rounded to bfloat16 (to nearest even,
   as torch's .to(bfloat16)), products summed and returned in float32. A product of bfloat16 inputs
   rounded to bfloat16 on output (what oneDNN returns) loses enough, over 30 layers, to change a
   small model's greedy answers; float32 accumulation and output do not. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_dot(const uint16_t *x, const uint16_t *w, int64_t K) {
    int64_t k = 0;
    float total = 0.0f;
#if defined(__AVX512BF16__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; k + 64 <= K; k += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(x + k + 32),
                                (__m512bh)_mm512_loadu_si512(w + k + 32));
    }
    for (; k + 32 <= K; k += 32)
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
    for (; k < K; k++) total += bf16_to_float(x[k]) * bf16_to_float(w[k]);
    return total;
}

/* y[m, n] = sum_k bf16(x[m, k]) * w[n, k] + bias[n]   (w bfloat16, row-major [N, K]) */
void bf16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, float *y, int64_t N) {
    uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * M * K + 64);
    for (int64_t i = 0; i < M * K; i++) xb[i] = float_to_bf16(x[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        for (int64_t o = 0; o < K; o += 32) __builtin_prefetch(wr + 4096 + o, 0, 3);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = bf16_dot(xb + m * K, wr, K) + (bias ? bias[n] : 0.0f);
    }
    free(xb);
}

/* If delta: x += delta (the residual stream, in place). Then out = rmsnorm(x) * w. */
void add_rms_norm(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        if (delta) {
            const float *dr = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}

static void head_norm_rope(float *v, const float *norm_w, const float *cos, const float *sin, int64_t D,
                           float eps) {
    if (norm_w) {
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < D; i++) ss += v[i] * v[i];
        float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) v[i] = v[i] * inv * norm_w[i];
    }
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* KV caches hold rows of D values: float32 (kind KV_F32), float16 (KV_F16, --kv-cache-dtype fp16) or
   int8 (KV_I8, --kv-cache-dtype int8: D int8 values, then their float32 scale, x ~ q * scale, the row's
   largest magnitude mapped to 127; ops/kv_fp8.py holds the torch reference). */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
static inline float half_to_float(uint16_t h);

static inline uint16_t float_to_half(float f) {  /* round to nearest even, as torch's .to(float16) */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, mant = x & 0x7fffff, e = (x >> 23) & 0xff;
    int32_t exp = (int32_t)e - 127 + 15;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        int shift = 14 - exp;
        uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)exp << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
}

/* Row `row` of a cache as float32: the row itself, or converted into tmp. */
static inline const float *kv_row(const void *cache, int64_t row, int64_t D, int kind, float *tmp) {
    if (kind == KV_F32) return (const float *)cache + row * D;
    int64_t i = 0;
    if (kind == KV_I8) {
        const int8_t *q = (const int8_t *)cache + row * (D + 4);
        float scale;
        memcpy(&scale, q + D, 4);
#ifdef __AVX2__
        __m256 s8 = _mm256_set1_ps(scale);
        for (; i + 8 <= D; i += 8) {
            __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)));
            _mm256_storeu_ps(tmp + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s8));
        }
#endif
        for (; i < D; i++) tmp[i] = (float)q[i] * scale;
        return tmp;
    }
    const uint16_t *h = (const uint16_t *)cache + row * D;
#ifdef __F16C__
    for (; i + 8 <= D; i += 8) _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < D; i++) tmp[i] = half_to_float(h[i]);
    return tmp;
}

static inline void kv_store(void *cache, int64_t row, const float *v, int64_t D, int kind) {
    if (kind == KV_F32) {
        memcpy((float *)cache + row * D, v, sizeof(float) * D);
        return;
    }
    int64_t i = 0;
    if (kind == KV_I8) {  /* as kv_fp8.quantize_int8: x / scale rounded to nearest even */
        int8_t *q = (int8_t *)cache + row * (D + 4);
        float amax = 0.0f;
        for (int64_t j = 0; j < D; j++) amax = fmaxf(amax, fabsf(v[j]));
        float scale = fmaxf(amax, 1e-30f) / 127.0f;
        for (; i < D; i++) {
            float r = nearbyintf(v[i] / scale);
            q[i] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
        }
        memcpy(q + D, &scale, 4);
        return;
    }
    uint16_t *h = (uint16_t *)cache + row * D;
#ifdef __F16C__
    for (; i + 8 <= D; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < D; i++) h[i] = float_to_half(v[i]);
}

/* One decode token per row. qkv: [B, (H + 2 Hkv) * D]. Writes rotated q to q_out [B, H, D] and the
   rotated k and v to the cache slots (flat cache [slots, Hkv, D]). */
void qkv_rope_store(const float *qkv, int64_t B, int64_t H, int64_t Hkv, int64_t D, const int64_t *positions,
                    const float *cos_table, const float *sin_table, const float *q_norm, const float *k_norm,
                    float eps, const int64_t *slots, void *k_cache, void *v_cache, float *q_out, int64_t kind) {
    int64_t width = (H + 2 * Hkv) * D;
    float *k = (float *)malloc(sizeof(float) * D + 64);
    for (int64_t b = 0; b < B; b++) {
        const float *row = qkv + b * width;
        const float *cos = cos_table + positions[b] * D, *sin = sin_table + positions[b] * D;
        float *q = q_out + b * H * D;
        memcpy(q, row, sizeof(float) * H * D);
        for (int64_t h = 0; h < H; h++) head_norm_rope(q + h * D, q_norm, cos, sin, D, eps);
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(k, row + (H + h) * D, sizeof(float) * D);
            head_norm_rope(k, k_norm, cos, sin, D, eps);
            kv_store(k_cache, slots[b] * Hkv + h, k, D, (int)kind);
            kv_store(v_cache, slots[b] * Hkv + h, row + (H + Hkv + h) * D, D, (int)kind);
        }
    }
    free(k);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* Eight values of a cache row, as float32 (an int8 row's values times its scale: kv_row's arithmetic). */
static inline __m256 kv_load8(const void *cache, int64_t row, int64_t D, int kind, int64_t i) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)cache + row * D + i);
    if (kind == KV_I8) {
        const int8_t *q = (const int8_t *)cache + row * (D + 4);
        float scale;
        memcpy(&scale, q + D, 4);
        __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(scale));
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + row * D + i)));
}

/* Keys and values are rows of a paged cache: one KV head's rows in a block are Hkv rows apart and the
   blocks lie anywhere, so the hardware prefetcher cannot follow them; the loops fetch the row KV_AHEAD
   positions on. */
#define KV_AHEAD 8
static inline void kv_prefetch(const void *cache, int64_t row, int64_t D, int kind) {
    int64_t bytes = kind == KV_F32 ? 4 * D : kind == KV_I8 ? D + 4 : 2 * D;
    const char *r = (const char *)cache + row * bytes;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(r + i, 0, 3);
}

/* One KV head's rows of a sequence, in position order from `first` (n of them), each call prefetching
   the row KV_AHEAD positions on. */
typedef struct { const int64_t *table; int64_t block_size, Hkv, kvh, blk, off, ahead_blk, ahead_off, left; } kv_walk_t;

static inline kv_walk_t kv_walk(const int64_t *table, int64_t first, int64_t n, int64_t block_size, int64_t Hkv,
                                int64_t kvh) {
    int64_t ahead = first + KV_AHEAD;
    kv_walk_t w = {table, block_size, Hkv, kvh, first / block_size, first % block_size, ahead / block_size,
                   ahead % block_size, n - KV_AHEAD};
    return w;
}

static inline int64_t kv_walk_next(kv_walk_t *w, const void *cache, int64_t D, int kind) {
    int64_t row = (w->table[w->blk] * w->block_size + w->off) * w->Hkv + w->kvh;
    if (++w->off == w->block_size) w->off = 0, w->blk++;
    if (w->left-- > 0) {
        kv_prefetch(cache, (w->table[w->ahead_blk] * w->block_size + w->ahead_off) * w->Hkv + w->kvh, D, kind);
        if (++w->ahead_off == w->block_size) w->ahead_off = 0, w->ahead_blk++;
    }
    return row;
}

/* The query heads that share KV head kvh (G of them, at most 8, their rows [G, D] at qh; outputs [G, D]
   at o; scores: G * (ctx - first) floats), over float32, float16 and int8 caches, D a multiple of 8 (at
   most 256): each key and value row is read once for all G heads. Each head's operations are those of the
   portable loops of attend_head as they compile on an AVX2 machine, in the same order (a score:
   eight-lane products added chunk by chunk, the lanes summed in order; an output: one fused
   multiply-add per key), so a head's result is the same bits alone or in its group. The keys'
   positions are walked block by block, not divided out. */
static inline __attribute__((always_inline)) void attend_group_g(const float *qh, const int64_t G,
        const void *k_cache, const void *v_cache, const int64_t *table, int64_t first, int64_t ctx, int64_t Hkv,
        int64_t kvh, int64_t D, int64_t block_size, float scale, float *scores, float *o, int kind) {
    int64_t n = ctx - first, chunks = D / 8;
    float best[8];
    for (int64_t g = 0; g < G; g++) best[g] = -INFINITY;
    kv_walk_t keys = kv_walk(table, first, n, block_size, Hkv, kvh);
    for (int64_t t = 0; t < n; t++) {
        int64_t row = kv_walk_next(&keys, k_cache, D, kind);
        __m256 acc[8];
        for (int64_t g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __m256 k = kv_load8(k_cache, row, D, kind, 8 * c);
            for (int64_t g = 0; g < G; g++) {
                __m256 m = _mm256_mul_ps(_mm256_loadu_ps(qh + g * D + 8 * c), k);
                __asm__("" : "+x"(m));  /* a product rounded, then added: never contracted into an FMA */
                acc[g] = _mm256_add_ps(acc[g], m);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float lanes[8], s = 0.0f;
            _mm256_storeu_ps(lanes, acc[g]);
            for (int l = 0; l < 8; l++) s += lanes[l];
            s *= scale;
            scores[g * n + t] = s;
            if (s > best[g]) best[g] = s;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = scores + g * n, total = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            sc[t] = expf(sc[t] - best[g]);
            total += sc[t];
        }
        for (int64_t t = 0; t < n; t++) sc[t] = sc[t] / total;
    }
    /* One pass over the values, each row read once for all heads; the sums in o (in L1). */
    for (int64_t i = 0; i < G * D; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
    kv_walk_t values = kv_walk(table, first, n, block_size, Hkv, kvh);
    for (int64_t t = 0; t < n; t++) {
        int64_t row = kv_walk_next(&values, v_cache, D, kind);
        __m256 p[8];
        for (int64_t g = 0; g < G; g++) p[g] = _mm256_set1_ps(scores[g * n + t]);
        for (int64_t c = 0; c < chunks; c++) {
            __m256 v = kv_load8(v_cache, row, D, kind, 8 * c);
            for (int64_t g = 0; g < G; g++) {
                float *og = o + g * D + 8 * c;
                _mm256_storeu_ps(og, _mm256_fmadd_ps(p[g], v, _mm256_loadu_ps(og)));
            }
        }
    }
}

/* attend_group_g with G a constant in each case, so that its loops over the heads unroll. */
static void attend_group_avx2(const float *qh, int64_t G, const void *k_cache, const void *v_cache,
                              const int64_t *table, int64_t first, int64_t ctx, int64_t Hkv, int64_t kvh,
                              int64_t D, int64_t block_size, float scale, float *scores, float *o, int kind) {
#define ATTEND_G(g) attend_group_g(qh, g, k_cache, v_cache, table, first, ctx, Hkv, kvh, D, block_size, scale, scores, o, kind)
    switch (G) {
        case 1: ATTEND_G(1); break;
        case 2: ATTEND_G(2); break;
        case 3: ATTEND_G(3); break;
        case 4: ATTEND_G(4); break;
        case 5: ATTEND_G(5); break;
        case 6: ATTEND_G(6); break;
        case 7: ATTEND_G(7); break;
        default: ATTEND_G(8); break;
    }
#undef ATTEND_G
}
#endif

/* One query head attending over its sequence's paged keys and values (the portable path of attend_group).
   scores: scratch for ctx - first floats; window > 0: only the last `window` keys. */
static void attend_head(const float *qh, const void *k_cache, const void *v_cache, const int64_t *table,
                        int64_t ctx, int64_t window, int64_t Hkv, int64_t kvh, int64_t D, int64_t block_size,
                        float scale, float *scores, float *o, int kind) {
    int64_t first = window > 0 && ctx > window ? ctx - window : 0;
    float best = -INFINITY, tmp[kind == KV_F32 ? 1 : D];
    for (int64_t t = first; t < ctx; t++) {
        int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float *kt = kv_row(k_cache, slot * Hkv + kvh, D, kind, tmp);
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < D; i++) s += qh[i] * kt[i];
        s *= scale;
        scores[t - first] = s;
        if (s > best) best = s;
    }
    float total = 0.0f;
    for (int64_t t = first; t < ctx; t++) {
        scores[t - first] = expf(scores[t - first] - best);
        total += scores[t - first];
    }
    for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
    for (int64_t t = first; t < ctx; t++) {
        int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float *vt = kv_row(v_cache, slot * Hkv + kvh, D, kind, tmp);
        float p = scores[t - first] / total;
        #pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] += p * vt[i];
    }
}

/* How many of a KV head's G query heads one chunk of decode attention takes: all of them (each key and
   value row read once) unless that leaves fewer than two chunks a thread (B x Hkv chunks: a 1-KV-head
   model at batch 1 would run on one thread), then halved until it does not. A head's result is the
   same bits in any split, so this may depend on the batch and the thread count. */
static int64_t attention_split(int64_t B, int64_t Hkv, int64_t G, int threads) {
    int64_t S = G;
    while (S > 1 && B * Hkv * ((G + S - 1) / S) < 2 * threads) S = (S + 1) / 2;
    return S;
}

/* The G query heads that share KV head kvh attending over their sequence's paged keys and values (the
   fused decode step's and paged_decode_attention's): rows [G, D] at qh, outputs [G, D] at o; scores:
   scratch for min(G, 8) * ctx floats; window > 0: only the last `window` keys. */
static void attend_group(const float *qh, int64_t G, const void *k_cache, const void *v_cache,
                         const int64_t *table, int64_t ctx, int64_t window, int64_t Hkv, int64_t kvh, int64_t D,
                         int64_t block_size, float scale, float *scores, float *o, int kind) {
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    if (D % 8 == 0 && D <= 256) {
        int64_t first = window > 0 && ctx > window ? ctx - window : 0;
        for (int64_t g0 = 0; g0 < G; g0 += 8)
            attend_group_avx2(qh + g0 * D, G - g0 < 8 ? G - g0 : 8, k_cache, v_cache, table, first, ctx, Hkv, kvh,
                              D, block_size, scale, scores, o + g0 * D, kind);
        return;
    }
#endif
    for (int64_t g = 0; g < G; g++)
        attend_head(qh + g * D, k_cache, v_cache, table, ctx, window, Hkv, kvh, D, block_size, scale, scores,
                    o + g * D, kind);
}

/* Decode attention over a paged cache. q: [B, H, D]; tables: [B, max_blocks]; out: [B, H, D].
   window > 0: only the last `window` keys (sliding-window layers). */
void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                            int64_t max_blocks, const int64_t *context_lens, int64_t B, int64_t H, int64_t Hkv,
                            int64_t D, int64_t block_size, float scale, float *out, int64_t window, int64_t kind) {
    int64_t group = H / Hkv, S = attention_split(B, Hkv, group, omp_get_max_threads());
    int64_t parts = (group + S - 1) / S;
    #pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            for (int64_t part = 0; part < parts; part++) {
                int64_t ctx = context_lens[b], h0 = kvh * group + part * S;
                int64_t n = group - part * S < S ? group - part * S : S;
                float *scores = (float *)malloc(sizeof(float) * (n < 8 ? n : 8) * ctx);
                attend_group(q + (b * H + h0) * D, n, k_cache, v_cache, tables + b * max_blocks, ctx, window, Hkv,
                             kvh, D, block_size, scale, scores, out + (b * H + h0) * D, (int)kind);
                free(scores);
            }
        }
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
"""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "int8_linear": [_P, _I, _I, _P, _P, _P, _P, _I],
    "bf16_linear": [_P, _I, _I, _P, _P, _P, _I],
    "int4_linear": [_P, _I, _I, _P, _P, _P, _P, _P, _I],
    "int4_dequantize": [_P, _P, _P, _P, _I, _I],
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "qkv_rope_store": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, _I],
    "paged_decode_attention": [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I, _I],
    "silu_mul": [_P, _P, _I, _I],
    "llama_decode_step": [_P, _P, _I, _P, _P, _P, _I, _P, _I, _F, _F, _P],
    "gguf_linear": [_P, _I, _I, _P, _P, _I, _P, _P, _I],
    "gguf_dequantize": [_P, _P, _I, _P, _I, _I],
}

GGUF_SOURCE = Path(__file__).with_name("cpu_gguf.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC", "-lm"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _kernel_dir() -> Path:
    from trtedge.runtime.artifacts.checkpoint import default_cache_dir

    return default_cache_dir() / "kernels"


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with a logged reason) when no C compiler can build them."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed:
            return _lib
        try:
            _lib = compile_kernels(_kernel_dir())
        except Exception as e:  # no compiler, read-only cache, unsupported flags...
            _failed = True
            log.warning("native CPU kernels unavailable (%s); using float weights", e)
        return _lib


def library_name(source: str, compiler: str, cpu: str, flags: list[str] = _FLAGS) -> str:
    """The compiled library's file name: a digest of what decides its machine code. ``-march=native``
    compiles for the CPU it runs on, so the CPU's identity is part of it: a cache directory shared by
    machines (a network home, an image) must not hand one machine another's instructions."""
    digest = hashlib.sha256("\0".join([source, " ".join(flags), compiler, cpu]).encode()).hexdigest()[:16]
    return f"cpu_kernels-{digest}.so"


def _cpu_identity() -> str:
    """The CPU's model and feature flags as the kernel reports them (``/proc/cpuinfo``), else what
    ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    found = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in wanted and key not in found:
            found[key] = line
    if found:
        return "\n".join(found[k] for k in wanted if k in found)
    return f"{platform.machine()} {platform.processor()}"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (``avx2``, ``avx512_vnni``, ``amx_bf16`` ...)."""
    return set(_cpu_identity().split())


def compile_kernels(directory: Path, march: str = "native") -> ctypes.CDLL:
    """The kernels compiled for ``-march=march`` into ``directory`` (reused when there) and loaded.
    ``load()`` is this for the running CPU in the cache; tests and benchmarks build the code paths of
    an older instruction set (``x86-64-v3``: AVX2, no AVX-512) on a newer CPU with it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    flags = [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]
    source = SOURCE + cpu_int4.SOURCE + GGUF_SOURCE.read_text() + cpu_step.SOURCE
    target = directory / library_name(source, compiler, _cpu_identity(), flags)
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src = Path(tmp) / "kernels.c"
            src.write_text(source)
            out = Path(tmp) / "kernels.so"
            result = subprocess.run(
                [compiler, *flags, str(src), "-o", str(out)], capture_output=True, text=True, timeout=120
            )
            if result.returncode != 0:
                raise RuntimeError(f"compiling failed: {result.stderr.strip()[:300]}")
            os.replace(out, target)  # atomic: concurrent builders all end with a whole file
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = argtypes
    lib.int4_kernel_max_rows.restype = ctypes.c_int64
    lib.int4_kernel_max_rows.argtypes = [ctypes.c_int64, ctypes.c_int64]
    return lib


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


_KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}


def kv_kind(cache: torch.Tensor) -> int:
    """The kernels' code for a KV cache's rows (KV_F32, KV_F16, KV_I8)."""
    try:
        return _KV_KINDS[cache.dtype]
    except KeyError:
        raise ValueError(f"the native CPU kernels read no {cache.dtype} KV cache") from None


def add_rms_norm(
    lib, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    """In place: x += delta (if given); out = rmsnorm(x) * weight. All float32 contiguous [rows, dim]."""
    lib.add_rms_norm(
        x.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps
    )


def qkv_rope_store(
    lib,
    qkv,
    num_heads,
    num_kv_heads,
    head_dim,
    positions,
    cos,
    sin,
    q_norm,
    k_norm,
    eps,
    slots,
    k_cache,
    v_cache,
    q_out,
) -> None:
    """Decode rows: rotate (and q/k-norm) q into q_out, write rotated k and v into their cache slots."""
    lib.qkv_rope_store(
        qkv.data_ptr(),
        qkv.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        _ptr(q_norm),
        _ptr(k_norm),
        eps,
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q_out.data_ptr(),
        kv_kind(k_cache),
    )


def paged_decode_attention(
    lib, q, k_cache, v_cache, tables, context_lens, block_size, scale, out, window: int = 0
) -> None:
    b, h, d = q.shape
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        context_lens.data_ptr(),
        b,
        h,
        k_cache.shape[-2],
        d,
        block_size,
        scale,
        out.data_ptr(),
        window,
        kv_kind(k_cache),
    )


def silu_mul(lib, gate_up: torch.Tensor, out: torch.Tensor) -> None:
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])


def int8_linear(
    lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
):
    """x [M, K] float32 contiguous; w [N, K] int8; scale [N] float32 -> [M, N] float32."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.int8_linear(
        x.data_ptr(),
        m,
        k,
        w.data_ptr(),
        scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
    )
    return y


def bf16_linear(
    lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] float32 contiguous; w [N, K] bfloat16 contiguous -> [M, N] float32."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.bf16_linear(x.data_ptr(), m, k, w.data_ptr(), _ptr(bias), y.data_ptr(), n)
    return y


def int4_linear(lib: ctypes.CDLL, x: torch.Tensor, q, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous; q an int4 QuantizedTensor [N, K] -> [M, N] float32."""
    m, k = x.shape
    n = q.data.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.int4_linear(
        x.data_ptr(),
        m,
        k,
        q.data.data_ptr(),
        q.scale.data_ptr(),
        q.min.data_ptr(),
        _ptr(bias),
        y.data_ptr(),
        n,
    )
    return y


def gguf_linear(lib: ctypes.CDLL, x: torch.Tensor, q, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous; q a "gguf" QuantizedTensor [N, K] -> [M, N] float32."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.gguf_linear(
        x.data_ptr(),
        m,
        k,
        q.data.data_ptr(),
        q.scale.data_ptr(),
        q.scale.shape[0],
        _ptr(bias),
        y.data_ptr(),
        n,
    )
    return y


def gguf_dequantize(lib: ctypes.CDLL, q) -> torch.Tensor:
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.float32)
    lib.gguf_dequantize(q.data.data_ptr(), q.scale.data_ptr(), q.scale.shape[0], out.data_ptr(), n, k)
    return out


def int4_dequantize(lib: ctypes.CDLL, q) -> torch.Tensor:
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.float32)
    lib.int4_dequantize(q.data.data_ptr(), q.scale.data_ptr(), q.min.data_ptr(), out.data_ptr(), n, k)
    return out


class CpuDecodeKernels:
    """The decode-step kernels for the CPU, with the same calls as the Triton set."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def add_rms_norm(self, x, delta, weight, out, eps: float) -> None:
        add_rms_norm(self.lib, x, delta, weight, out, eps)

    def qkv_rope_store(self, *args) -> None:
        qkv_rope_store(self.lib, *args)

    def paged_decode_attention(
        self, q, k_cache, v_cache, tables, context_lens, block_size, scale, out, window: int = 0
    ) -> None:
        paged_decode_attention(
            self.lib, q, k_cache, v_cache, tables, context_lens, block_size, scale, out, window
        )

    def silu_mul(self, gate_up, out) -> None:
        silu_mul(self.lib, gate_up, out)
