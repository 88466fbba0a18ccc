"""The native int4 kernels (C source, compiled with the others in ``cpu_kernels``).

Weights: group-32 asymmetric int4 in the packing of ``runtime/artifacts/quantize.py`` (blocks of 16 groups,
then spans of two). Activations: each row is quantized per group of 32 inputs to int16
(dx = max|x| / 32767, plus the group's float sum), so that
``sum_k w_k x_k = sum_g scale_g dx_g sum_j q_j qx_j + min_g sum_g(x)``: integer dot products
(AVX-512 VNNI vpdpwssd) on the packed weights. int16 keeps the activations' own precision (int8
blocks, as llama.cpp's q4 x q8 uses, lose the small values next to an outlier).

In a block, one 16-lane dot product takes two inputs of each of the 16 groups, so a lane sums one
group over the whole block and the per-group scales apply once per block, as one vector; the
activations are stored in the same order (``qx_index``).
"""

SOURCE = r"""
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))
    return _cvtsh_ss(h);  /* one vcvtph2ps: exact for every finite half, subnormals included */
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Where input k of a row sits in the quantized activations (and, halved, which packed byte). */
static inline int64_t qx_index(int64_t k, int64_t K) {
    if (k >= K / 512 * 512) return k;
    int64_t r = k % 512, l = r / 32, j = r % 32;
    return k - r + (j / 4) * 64 + ((j / 2) % 2) * 32 + 2 * l + j % 2;
}

/* Packed byte b of a row: its low and high nibbles' inputs. */
static inline void int4_inputs(int64_t b, int64_t K, int64_t *lo, int64_t *hi) {
    int64_t whole = K / 512 * 512;
    if (b < whole / 2) {
        int64_t r = b % 256, c = r / 32, l = (r % 32) / 2, e = r % 2;
        *lo = b / 256 * 512 + l * 32 + 4 * c + e;
        *hi = *lo + 2;
        return;
    }
    int64_t start = whole + (b - whole / 2) / 32 * 64, half = K - start < 64 ? (K - start) / 2 : 32;
    *lo = start + (b - whole / 2) % 32;
    *hi = *lo + half;
}

/* Rows ahead of this one, while it is summed (weight_prefetch). With AVX2 (Zen 3) 8 KiB ahead into L1
   (~1.5x the bandwidth of no prefetch). With WEIGHT_PREFETCH_FAR (Zen 4) 64 KiB ahead into L2 only: a row alone
   at 1 thread ran 8-35% faster with no prefetch than 8 KiB ahead into L1, and mostly faster again with
   this one; the 1B model decoded 14.3 -> 16.7 tok/s at 1 thread (24.5 -> 26.9 at 2) without the L1
   prefetch, then 18.7 -> 21.3 (29.1 -> 30.6) with this one. */
static inline void int4_prefetch(const uint8_t *row, int64_t K) { weight_prefetch(row, K / 2); }

/* Group g of a row: its 32 inputs' int16 levels (dx = max|x| / 32767), dx and the float sum. */
static inline void quantize_group_q16(const float *xb, int16_t *q, float *dx, float *sx) {
    float amax = 0.0f, sum = 0.0f;
    for (int j = 0; j < 32; j++) {
        float a = fabsf(xb[j]);
        amax = a > amax ? a : amax;
        sum += xb[j];
    }
    float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int j = 0; j < 32; j++) q[j] = (int16_t)nearbyintf(xb[j] * id);
    *dx = amax / 32767.0f;
    *sx = sum;
}

static void quantize_row_q16(const float *x, int64_t K, int16_t *qx, float *dx, float *sx) {
    int16_t q[32];
    for (int64_t g = 0; g < K / 32; g++) {
        quantize_group_q16(x + g * 32, q, dx + g, sx + g);
        for (int j = 0; j < 32; j++) qx[qx_index(g * 32 + j, K)] = q[j];
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* A tail span of two groups (32 bytes: low nibbles group gb, high nibbles group gb + 1). */
#define INT4_SPAN(gb, A, B)                                                                          \
    {                                                                                                \
        __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + (gb) * 16)));      \
        __m512i qa = _mm512_and_si512(q, low4), qb = _mm512_srli_epi16(q, 4);                        \
        for (int r = 0; r < R; r++) {                                                                \
            const int16_t *xr = qx + r * K + (gb) * 32;                                              \
            __m512i da = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qa, _mm512_loadu_si512(xr));     \
            __m512i db = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qb, _mm512_loadu_si512(xr + 32)); \
            acc[r][A] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), _mm512_set1_ps(c[r][(gb) - b0]), acc[r][A]); \
            acc[r][B] =                                                                              \
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), _mm512_set1_ps(c[r][(gb) - b0 + 1]), acc[r][B]); \
        }                                                                                            \
    }

/* One packed weight row (G groups; its scale and min rows) against R (1..4) quantized activation
   rows; R is a constant in each caller, so the loops over it unroll. */
static inline __attribute__((always_inline)) void int4_rows_r(const uint8_t *w, const uint16_t *scale,
        const uint16_t *mins, int64_t G, const int16_t *qx, const float *dx, const float *sx, int64_t K,
        const int R, float *out) {
    const __m512i low4 = _mm512_set1_epi16(0x0f);
    __m512 acc[4][4], off[4];
    float c[4][16];
    for (int r = 0; r < R; r++) {
        off[r] = _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    }
    int64_t blocks = G / 16;
    for (int64_t bl = 0; bl < blocks; bl++) {
        const uint8_t *wb = w + bl * 256;
        __m512i a[4][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) a[r][i] = _mm512_setzero_si512();
        for (int ch = 0; ch < 8; ch += 2) {
            __m512i q0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wb + ch * 32)));
            __m512i q1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wb + ch * 32 + 32)));
            __m512i l0 = _mm512_and_si512(q0, low4), h0 = _mm512_srli_epi16(q0, 4);
            __m512i l1 = _mm512_and_si512(q1, low4), h1 = _mm512_srli_epi16(q1, 4);
            for (int r = 0; r < R; r++) {
                const int16_t *xr = qx + r * K + bl * 512 + ch * 64;
                a[r][0] = _mm512_dpwssd_epi32(a[r][0], l0, _mm512_loadu_si512(xr));
                a[r][1] = _mm512_dpwssd_epi32(a[r][1], h0, _mm512_loadu_si512(xr + 32));
                a[r][2] = _mm512_dpwssd_epi32(a[r][2], l1, _mm512_loadu_si512(xr + 64));
                a[r][3] = _mm512_dpwssd_epi32(a[r][3], h1, _mm512_loadu_si512(xr + 96));
            }
        }
        __m512 cw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + bl * 16)));
        __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + bl * 16)));
        for (int r = 0; r < R; r++) {
            __m512i s = _mm512_add_epi32(_mm512_add_epi32(a[r][0], a[r][1]), _mm512_add_epi32(a[r][2], a[r][3]));
            __m512 cr = _mm512_mul_ps(cw, _mm512_loadu_ps(dx + r * G + bl * 16));
            acc[r][bl & 3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), cr, acc[r][bl & 3]);
            off[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(sx + r * G + bl * 16), off[r]);
        }
    }
    if (blocks * 16 < G) {  /* the tail: fewer than 16 groups, in spans */
        int64_t b0 = blocks * 16, nb = G - b0;
        __mmask16 mask = (__mmask16)((1u << nb) - 1);
        __m512 cw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scale + b0));
        __m512 mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + b0));
        for (int r = 0; r < R; r++) {
            _mm512_storeu_ps(c[r], _mm512_mul_ps(cw, _mm512_maskz_loadu_ps(mask, dx + r * G + b0)));
            off[r] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(mask, sx + r * G + b0), off[r]);
        }
        int64_t b = b0;
        for (; b + 4 <= G; b += 4) {
            INT4_SPAN(b, 0, 1)
            INT4_SPAN(b + 2, 2, 3)
        }
        for (; b + 2 <= G; b += 2) {
            INT4_SPAN(b, 0, 1)
        }
        if (b < G) {  /* an odd last group: 16 bytes, inputs j and 16 + j */
            __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + b * 16)));
            __m512i qv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, _mm256_set1_epi16(0x0f))),
                                            _mm256_srli_epi16(q, 4), 1);
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qv, _mm512_loadu_si512(qx + r * K + b * 32));
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(c[r][b - b0]), acc[r][0]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(sum, off[r]));
    }
}

static void int4_rows(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, int64_t G, const int16_t *qx,
                      const float *dx, const float *sx, int64_t K, int R, float *out) {
    switch (R) {
        case 1: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 1, out); break;
        case 2: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 2, out); break;
        case 3: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 3, out); break;
        default: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 4, out); break;
    }
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* AVX2 (no AVX-512): 16-bit multiply-adds (vpmaddwd) of the unpacked nibbles and the activations.
   Bytes 0..15 of a 32-byte chunk hold groups 0..7 of the block (byte 2 l + e: group l), bytes
   16..31 groups 8..15, so each 8-lane sum is one group per lane and the scales apply per block. */
static inline __attribute__((always_inline)) void int4_rows_r(const uint8_t *w, const uint16_t *scale,
        const uint16_t *mins, int64_t G, const int16_t *qx, const float *dx, const float *sx, int64_t K,
        const int R, float *out) {
    const __m256i low4 = _mm256_set1_epi16(0x0f);
    __m256 acc[4], off[4];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm256_setzero_ps();
    int64_t blocks = G / 16;
    for (int64_t bl = 0; bl < blocks; bl++) {
        const uint8_t *wb = w + bl * 256;
        __m256i a[4][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int ch = 0; ch < 8; ch++) {
            __m256i q0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + ch * 32)));
            __m256i q1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + ch * 32 + 16)));
            __m256i l0 = _mm256_and_si256(q0, low4), h0 = _mm256_srli_epi16(q0, 4);
            __m256i l1 = _mm256_and_si256(q1, low4), h1 = _mm256_srli_epi16(q1, 4);
            for (int r = 0; r < R; r++) {
                const int16_t *xr = qx + r * K + bl * 512 + ch * 64;
                __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(l0, _mm256_loadu_si256((const __m256i *)xr)),
                                              _mm256_madd_epi16(h0, _mm256_loadu_si256((const __m256i *)(xr + 32))));
                __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(l1, _mm256_loadu_si256((const __m256i *)(xr + 16))),
                                              _mm256_madd_epi16(h1, _mm256_loadu_si256((const __m256i *)(xr + 48))));
                a[r][0] = _mm256_add_epi32(a[r][0], s0);
                a[r][1] = _mm256_add_epi32(a[r][1], s1);
            }
        }
        __m256 c0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + bl * 16)));
        __m256 c1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + bl * 16 + 8)));
        __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + bl * 16)));
        __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + bl * 16 + 8)));
        for (int r = 0; r < R; r++) {
            const float *d = dx + r * G + bl * 16, *s = sx + r * G + bl * 16;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), _mm256_mul_ps(c0, _mm256_loadu_ps(d)), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), _mm256_mul_ps(c1, _mm256_loadu_ps(d + 8)), acc[r]);
            off[r] = _mm256_fmadd_ps(m0, _mm256_loadu_ps(s), off[r]);
            off[r] = _mm256_fmadd_ps(m1, _mm256_loadu_ps(s + 8), off[r]);
        }
    }
    /* The tail past the last whole block: spans of 64 inputs in their own order (byte i of a span:
       inputs i and 32 + i, so its low nibbles are one group and its high nibbles the next), summed
       into each row's lanes with vector intrinsics only, so that a row's value is the same bits for
       every R (scalar expressions here could be vectorized or fused across rows differently per R). */
    const int64_t whole = blocks * 512, spans = (K - whole) / 64;
    for (int64_t sp = 0; sp < spans; sp++) {
        const uint8_t *wb = w + whole / 2 + sp * 32;
        __m256i q0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wb));
        __m256i q1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16)));
        __m256i l0 = _mm256_and_si256(q0, low4), h0 = _mm256_srli_epi16(q0, 4);
        __m256i l1 = _mm256_and_si256(q1, low4), h1 = _mm256_srli_epi16(q1, 4);
        const int64_t g = (whole + sp * 64) / 32;
        const __m256 c0 = _mm256_set1_ps(half_to_float(scale[g])), c1 = _mm256_set1_ps(half_to_float(scale[g + 1]));
        for (int r = 0; r < R; r++) {
            const int16_t *xr = qx + r * K + whole + sp * 64;
            __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(l0, _mm256_loadu_si256((const __m256i *)xr)),
                                          _mm256_madd_epi16(l1, _mm256_loadu_si256((const __m256i *)(xr + 16))));
            __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(h0, _mm256_loadu_si256((const __m256i *)(xr + 32))),
                                          _mm256_madd_epi16(h1, _mm256_loadu_si256((const __m256i *)(xr + 48))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(c0, _mm256_broadcast_ss(dx + r * G + g)), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(c1, _mm256_broadcast_ss(dx + r * G + g + 1)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const int16_t *xr = qx + r * K;
        const float *dr = dx + r * G, *sr = sx + r * G;
        float lanes[8], total = 0.0f;
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[r], off[r]));
        for (int i = 0; i < 8; i++) total += lanes[i];
        for (int64_t b = whole / 2 + spans * 32; b < K / 2; b++) {  /* a last half span: scalar */
            int64_t lo, hi;
            int4_inputs(b, K, &lo, &hi);
            total += (float)((w[b] & 0x0f) * xr[lo]) * half_to_float(scale[lo / 32]) * dr[lo / 32];
            total += (float)((w[b] >> 4) * xr[hi]) * half_to_float(scale[hi / 32]) * dr[hi / 32];
        }
        for (int64_t g = blocks * 16; g < G; g++) total += half_to_float(mins[g]) * sr[g];
        out[r] = total;
    }
}

static void int4_rows(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, int64_t G, const int16_t *qx,
                      const float *dx, const float *sx, int64_t K, int R, float *out) {
    switch (R) {
        case 1: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 1, out); break;
        case 2: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 2, out); break;
        case 3: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 3, out); break;
        default: int4_rows_r(w, scale, mins, G, qx, dx, sx, K, 4, out); break;
    }
}
#else
/* Without AVX-512 VNNI or AVX2: the same integer sums per group, in loops the compiler vectorizes. Lane i of a chunk of 32 packed bytes pairs its low nibble with input 64 c + i and its high
   nibble with input 64 c + 32 + i of the quantized activations (qx_index); lanes 2 l and 2 l + 1
   belong to group l of the block. */
static void int4_rows(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, int64_t G, const int16_t *qx,
                      const float *dx, const float *sx, int64_t K, int R, float *out) {
    int64_t blocks = G / 16;
    for (int r = 0; r < R; r++) {
        const int16_t *xr = qx + r * K;
        const float *dr = dx + r * G, *sr = sx + r * G;
        float total = 0.0f;
        for (int64_t bl = 0; bl < blocks; bl++) {
            const uint8_t *wb = w + bl * 256;
            const int16_t *xb = xr + bl * 512;
            int32_t acc[32] = {0};
            for (int ch = 0; ch < 8; ch++)
                for (int i = 0; i < 32; i++) {
                    int32_t q = wb[ch * 32 + i];
                    acc[i] += (q & 0x0f) * xb[ch * 64 + i] + (q >> 4) * xb[ch * 64 + 32 + i];
                }
            for (int l = 0; l < 16; l++)
                total += (float)(acc[2 * l] + acc[2 * l + 1]) * half_to_float(scale[bl * 16 + l]) * dr[bl * 16 + l];
        }
        for (int64_t b = blocks * 256; b < K / 2; b++) {  /* the tail (spans): inputs in their own order */
            int64_t lo, hi;
            int4_inputs(b, K, &lo, &hi);
            total += (float)((w[b] & 0x0f) * xr[lo]) * half_to_float(scale[lo / 32]) * dr[lo / 32];
            total += (float)((w[b] >> 4) * xr[hi]) * half_to_float(scale[hi / 32]) * dr[hi / 32];
        }
        for (int64_t g = 0; g < G; g++) total += half_to_float(mins[g]) * sr[g];
        out[r] = total;
    }
}
#endif

/* The integer GEMM below runs with AVX2 (ymm vpmaddwd + vpaddd), and with AVX-512 VNNI on AMD's Zen cores
   (byte products, vpdpbusd on zmm: on Zen 4 206-272 GFLOP/s on 2 cores at 128 and 1,024 rows, above the
   float32 BLAS). On an Intel Xeon with AVX-512 (two full-width FMA units) the ymm vpmaddwd form ran 86-93
   GFLOP/s against the BLAS's 169-204 at 1,024 rows, so there prefill rows past the decode kernel's take the
   BLAS (the byte form is not measured there). */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && defined(__x86_64__)
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#define INT4_GEMM 1
#elif defined(__znver3__) || defined(__znver4__) || defined(__znver5__)  /* gcc 12 names Zen 4 znver3 */
#define INT4_GEMM 1
#define GEMM_VNNI_ORDER 1
#endif
#endif

#ifdef INT4_GEMM
#define GEMM_NT 16  /* weight rows of a tile */

/* Block bl of weight row n, the tile's row i: its float scales into cs ([block][row][16]) and its mins into
   ms ([row][G]), as both GEMM tiles keep them. */
static inline void int4_gemm_tile_scales(const uint16_t *scale, const uint16_t *mins, int64_t n, int64_t G, int i,
                                         int64_t bl, float *cs, float *ms) {
    for (int h = 0; h < 16; h += 8) {
        _mm256_store_ps(cs + (bl * GEMM_NT + i) * 16 + h,
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + n * G + bl * 16 + h))));
        _mm256_storeu_ps(ms + i * G + bl * 16 + h,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + n * G + bl * 16 + h))));
    }
}

#ifndef GEMM_VNNI_ORDER  /* the int16 tiles (AVX2); on Zen 4 the byte tiles below */
/* Weight rows n0 .. n0 + GEMM_NT - 1 of a GEMM tile, unpacked to int16 in the activations' order (qx_index), a
   row every ldw int16 (a row past N repeats the last one, its outputs unused); cs: their float scales block by
   block ([block][row][16]); ms: their mins row by row ([row][G]). */
static void int4_gemm_tile(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, int64_t N, int64_t K,
                           int64_t n0, int16_t *wbuf, int64_t ldw, float *cs, float *ms) {
    const int64_t G = K / 32, blocks = G / 16;
    const __m256i low4 = _mm256_set1_epi16(0x0f);
    for (int i = 0; i < GEMM_NT; i++) {
        const int64_t n = n0 + i < N ? n0 + i : N - 1;
        const uint8_t *wr = w + n * (K / 2);
        for (int64_t bl = 0; bl < blocks; bl++) {
            for (int ch = 0; ch < 8; ch++) {
                const uint8_t *wb = wr + bl * 256 + ch * 32;
                int16_t *o = wbuf + i * ldw + bl * 512 + ch * 64;
                __m256i q0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wb));
                __m256i q1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16)));
                _mm256_store_si256((__m256i *)o, _mm256_and_si256(q0, low4));
                _mm256_store_si256((__m256i *)(o + 16), _mm256_and_si256(q1, low4));
                _mm256_store_si256((__m256i *)(o + 32), _mm256_srli_epi16(q0, 4));
                _mm256_store_si256((__m256i *)(o + 48), _mm256_srli_epi16(q1, 4));
            }
            int4_gemm_tile_scales(scale, mins, n, G, i, bl, cs, ms);
        }
    }
}
#endif

/* Many activation rows (prefill): a tile of GEMM_NT weight rows is unpacked once, in the activations'
   order (qx_index); block by block, each block of the tile stays in L1 while a chunk of activation rows
   passes by it, 2 weight rows x 4 activation rows at a time: with AVX2, 16-bit multiply-adds (vpmaddwd);
   on Zen 4 (GEMM_VNNI_ORDER), byte products (vpdpbusd on zmm, int4_gemm_block_bytes: 206-272 GFLOP/s on
   2 cores at the 1B shapes, 128 and 1,024 rows, where ymm vpmaddwd + vpaddd had run 177-202 and
   vpdpwssd on zmm 118-140). Every (weight row, activation row)
   takes the decode kernel's (int4_rows_r's) float operations in its order, and integer sums are exact
   in any order, so a row is the same bits alone, in a decode batch and in a prefill:
   - AVX2: per block the int32 sums of groups 0..7, then of 8..15, each times scale * dx into the pair's
     one accumulator; the mins' term apart; the lane sum.
   - AVX-512 VNNI: per block the sums of the 16 groups times scale * dx into accumulator block % 4 of the
     pair's four (its lanes 0..7 and 8..15 are the block's two halves: lane by lane the same operations);
     the mins' term apart; ((a0 + a1) + (a2 + a3) + mins) reduced as _mm512_reduce_add_ps does.
   K is a multiple of 512 (whole blocks): a tail's spans, summed per row as int4_rows_r sums them, made
   the embedded model's K = 576 prefill slower than dequantize + BLAS (on Zen 4 too: 87-109 GFLOP/s
   against 152-190 for its layers at 512 rows, a single block a row leaving the per-pair work to dominate). */
#ifdef GEMM_VNNI_ORDER
#define GEMM_MC 128    /* activation rows of a chunk: their float accumulators (GEMM_NT x 256 bytes a row, 512 KiB) in L2 */
#define GEMM_PAIR 64   /* floats of a pair's accumulators: 4 x 16 */
/* the accumulator of pairs (0, r) and (1, r) for half H of the block (p: the block's slot of pair (0, 0)) */
#define GEMM_ACC0(D, H) "(" D "*4+" H ")"
#define GEMM_ACC1(D, H) "1024+(" D "*4+" H ")"
#define GEMM_SLOT(bl) (((bl) & 3) * 16)  /* the block's accumulator of a pair's four */
#else
#define GEMM_MC 256    /* activation rows of a chunk: their float accumulators (GEMM_NT x 32 bytes a row) in L2 */
#define GEMM_PAIR 8    /* floats of a pair's accumulator */
#define GEMM_ACC0(D, H) "(" D "/2)"
#define GEMM_ACC1(D, H) "128+(" D "/2)"
#define GEMM_SLOT(bl) 0
#endif

/* Half h of a block (its groups 8 h .. 8 h + 7: inputs 32 j + 16 h .. + 15, j = 0..15, at byte 64 j + H)
   of weight rows w0, w1 and activation rows x0..x3 into ymm8..15 (weight row i, activation row r:
   ymm(8 + 4 i + r)), then acc[i][r] += float(sums) * (c[i] * d[r]): c, the two rows' float scales of the
   block ([2][16]), d, the four rows' dx of the block ([4][16]), acc [2][4][GEMM_PAIR] (AVX2 only: with
   AVX-512 VNNI the byte tiles, INT4_GEMM_BYTES_BLOCK, take both halves of a block at once). */
#define INT4_GEMM_HALF(H)                                                                                  \
    "vpxor %%xmm8, %%xmm8, %%xmm8\n\tvpxor %%xmm9, %%xmm9, %%xmm9\n\t"                                     \
    "vpxor %%xmm10, %%xmm10, %%xmm10\n\tvpxor %%xmm11, %%xmm11, %%xmm11\n\t"                               \
    "vpxor %%xmm12, %%xmm12, %%xmm12\n\tvpxor %%xmm13, %%xmm13, %%xmm13\n\t"                               \
    "vpxor %%xmm14, %%xmm14, %%xmm14\n\tvpxor %%xmm15, %%xmm15, %%xmm15\n\t"                               \
    "xor %[o], %[o]\n\t"                                                                                   \
    "1:\n\t"                                                                                               \
    "vmovdqa " H "(%[w0],%[o]), %%ymm0\n\tvmovdqa " H "(%[w1],%[o]), %%ymm1\n\t"                           \
    "vmovdqa " H "(%[x0],%[o]), %%ymm2\n\tvmovdqa " H "(%[x1],%[o]), %%ymm3\n\t"                           \
    "vmovdqa " H "(%[x2],%[o]), %%ymm4\n\tvmovdqa " H "(%[x3],%[o]), %%ymm5\n\t"                           \
    "vpmaddwd %%ymm2, %%ymm0, %%ymm6\n\tvpmaddwd %%ymm3, %%ymm0, %%ymm7\n\t"                               \
    "vpaddd %%ymm6, %%ymm8, %%ymm8\n\tvpaddd %%ymm7, %%ymm9, %%ymm9\n\t"                                   \
    "vpmaddwd %%ymm4, %%ymm0, %%ymm6\n\tvpmaddwd %%ymm5, %%ymm0, %%ymm7\n\t"                               \
    "vpaddd %%ymm6, %%ymm10, %%ymm10\n\tvpaddd %%ymm7, %%ymm11, %%ymm11\n\t"                               \
    "vpmaddwd %%ymm2, %%ymm1, %%ymm6\n\tvpmaddwd %%ymm3, %%ymm1, %%ymm7\n\t"                               \
    "vpaddd %%ymm6, %%ymm12, %%ymm12\n\tvpaddd %%ymm7, %%ymm13, %%ymm13\n\t"                               \
    "vpmaddwd %%ymm4, %%ymm1, %%ymm6\n\tvpmaddwd %%ymm5, %%ymm1, %%ymm7\n\t"                               \
    "vpaddd %%ymm6, %%ymm14, %%ymm14\n\tvpaddd %%ymm7, %%ymm15, %%ymm15\n\t"                               \
    "add $64, %[o]\n\tcmp $1024, %[o]\n\tjne 1b\n\t"                                                       \
    "vmovups " H "(%[c]), %%ymm0\n\tvmovups 64+" H "(%[c]), %%ymm1\n\t"                                    \
    INT4_GEMM_PAIRS(H, "0", "8", "12") INT4_GEMM_PAIRS(H, "64", "9", "13")                                 \
    INT4_GEMM_PAIRS(H, "128", "10", "14") INT4_GEMM_PAIRS(H, "192", "11", "15")
/* activation row r (its dx at byte D of d): pairs (0, r) in ymm A, (1, r) in ymm B */
#define INT4_GEMM_PAIRS(H, D, A, B)                                                                        \
    "vmovups " D "+" H "(%[d]), %%ymm2\n\t"                                                                \
    "vmulps %%ymm2, %%ymm0, %%ymm3\n\tvmulps %%ymm2, %%ymm1, %%ymm4\n\t"                                    \
    "vcvtdq2ps %%ymm" A ", %%ymm" A "\n\tvcvtdq2ps %%ymm" B ", %%ymm" B "\n\t"                             \
    "vfmadd213ps " GEMM_ACC0(D, H) "(%[p]), %%ymm3, %%ymm" A "\n\t"                                         \
    "vfmadd213ps " GEMM_ACC1(D, H) "(%[p]), %%ymm4, %%ymm" B "\n\t"                                         \
    "vmovaps %%ymm" A ", " GEMM_ACC0(D, H) "(%[p])\n\tvmovaps %%ymm" B ", " GEMM_ACC1(D, H) "(%[p])\n\t"

#ifndef GEMM_VNNI_ORDER
/* One block (w0, w1: its unpacked weights; x0..x3: its activations) of 2 x 4 (weight, activation)
   rows, in assembly: the compiler's allocation of the 14 registers spilled an accumulator, whose
   store and reload bound the loop. */
static inline __attribute__((always_inline)) void int4_gemm_block(const int16_t *w0, const int16_t *w1,
        const int16_t *x0, const int16_t *x1, const int16_t *x2, const int16_t *x3, const float *c, const float *d,
        float *acc) {
    int64_t o;
    __asm__ volatile(INT4_GEMM_HALF("0") INT4_GEMM_HALF("32")
                     : [o] "=&r"(o)
                     : [w0] "r"(w0), [w1] "r"(w1), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [c] "r"(c),
                       [d] "r"(d), [p] "r"(acc)
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                       "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
}
#endif

#ifdef GEMM_VNNI_ORDER
/* With AVX-512 VNNI the tiles multiply bytes (vpdpbusd: 4 byte products summed into a 32-bit lane, where
   vpmaddwd sums 2 16-bit ones and needs a vpaddd). An activation's int16 level x is its two bytes,
   x = 256 hi + lo (hi signed, lo unsigned), stored as two unsigned planes, hi + 128 and lo; a weight's
   level (0..15) is the signed operand. Per group the lanes give A = sum w (hi + 128) and B = sum w lo, and
   sum w x = 256 A + B - 32768 sum w, exact in int32 (|256 A| < 2^25): the int16 path's integers, so the
   float operations after them, and their bits, are the same. In a block (512 inputs) a row's planes are
   [hi: 512 bytes][lo: 512 bytes], the weights' unpacked bytes 512; input 32 g + j of the block at byte
   (j / 4) 64 + (g / 8) 32 + (g % 8) 4 + j % 4: a 64-byte load at 64 i holds inputs 4 i .. 4 i + 3 of the 16
   groups, a group to a lane (its halves, bytes 0..31 and 32..63, the int16 path's two halves of a block). */
static inline int64_t plane_index(int64_t r) {
    int64_t g = r / 32, j = r % 32;
    return (j / 4) * 64 + (g / 8) * 32 + (g % 8) * 4 + j % 4;
}

/* A row's activations for the byte tiles (K a multiple of 512): quantize_row_q16's levels, dx and sums. */
static void quantize_row_planes(const float *x, int64_t K, uint8_t *p, float *dx, float *sx) {
    int16_t q[32];
    for (int64_t g = 0; g < K / 32; g++) {
        quantize_group_q16(x + g * 32, q, dx + g, sx + g);
        uint8_t *pb = p + g / 16 * 1024;
        for (int j = 0; j < 32; j++) {
            const int64_t o = plane_index((g % 16) * 32 + j);
            pb[o] = (uint8_t)(((uint16_t)q[j] >> 8) ^ 0x80);  /* (x >> 8) + 128 */
            pb[512 + o] = (uint8_t)((uint16_t)q[j] & 0xff);
        }
    }
}

/* Weight rows n0 .. n0 + GEMM_NT - 1 unpacked to bytes in the planes' order, a row every ldw bytes (a row
   past N repeats the last one); corr: 32768 x each group's sum of levels ([row][block][16]); cs, ms as
   int4_gemm_tile gives them. A packed chunk (32 bytes: bytes 2 l, 2 l + 1 of group l hold inputs 4 ch + 0,
   1 in their low nibbles and 4 ch + 2, 3 in their high ones) is the low and high nibbles interleaved word
   by word. */
static void int4_gemm_tile_bytes(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, int64_t N, int64_t K,
                                 int64_t n0, uint8_t *wbuf, int64_t ldw, int32_t *corr, float *cs, float *ms) {
    const int64_t G = K / 32, blocks = G / 16;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int i = 0; i < GEMM_NT; i++) {
        const int64_t n = n0 + i < N ? n0 + i : N - 1;
        const uint8_t *wr = w + n * (K / 2);
        for (int64_t bl = 0; bl < blocks; bl++) {
            uint8_t *o = wbuf + i * ldw + bl * 512;
            for (int ch = 0; ch < 8; ch++)
                for (int h = 0; h < 2; h++) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(wr + bl * 256 + ch * 32 + h * 16));
                    const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
                    _mm_store_si128((__m128i *)(o + ch * 64 + h * 32), _mm_unpacklo_epi16(lo, hi));
                    _mm_store_si128((__m128i *)(o + ch * 64 + h * 32 + 16), _mm_unpackhi_epi16(lo, hi));
                }
            for (int h = 0; h < 2; h++) {
                __m256i sum = _mm256_setzero_si256();
                for (int ch = 0; ch < 8; ch++)
                    sum = _mm256_dpbusd_epi32(sum, ones, _mm256_load_si256((const __m256i *)(o + ch * 64 + h * 32)));
                _mm256_storeu_si256((__m256i *)(corr + (i * blocks + bl) * 16 + h * 8), _mm256_slli_epi32(sum, 15));
            }
            int4_gemm_tile_scales(scale, mins, n, G, i, bl, cs, ms);
        }
    }
}

/* Activation row X's hi and lo planes (zmm XH, XL) times weight rows 0 and 1 (zmm0, zmm1) into the
   accumulators of pairs (0, X): A0H, A0L and (1, X): A1H, A1L. */
#define INT4_GEMM_BYTES_ROW(X, XH, XL, A0H, A0L, A1H, A1L)                                                  \
    "vmovdqa64 (%[" X "],%[o]), %%zmm" XH "\n\tvmovdqa64 512(%[" X "],%[o]), %%zmm" XL "\n\t"               \
    "vpdpbusd %%zmm0, %%zmm" XH ", %%zmm" A0H "\n\tvpdpbusd %%zmm0, %%zmm" XL ", %%zmm" A0L "\n\t"           \
    "vpdpbusd %%zmm1, %%zmm" XH ", %%zmm" A1H "\n\tvpdpbusd %%zmm1, %%zmm" XL ", %%zmm" A1L "\n\t"
/* zmm AH = 256 AH + AL - zmm K: the pair's int16-level sums */
#define INT4_GEMM_BYTES_JOIN(AH, AL, K)                                                                     \
    "vpslld $8, %%zmm" AH ", %%zmm" AH "\n\tvpaddd %%zmm" AL ", %%zmm" AH ", %%zmm" AH "\n\t"               \
    "vpsubd %%zmm" K ", %%zmm" AH ", %%zmm" AH "\n\t"
/* activation row r (its dx at byte D of d): acc[i][r] += float(sums) * (c[i] * d[r]) for the block's 16
   groups at once, lane by lane INT4_GEMM_PAIRS's operations on both halves */
#define INT4_GEMM_BYTES_PAIRS(D, A, B)                                                                      \
    "vmovups " D "(%[d]), %%zmm2\n\t"                                                                      \
    "vmulps %%zmm2, %%zmm0, %%zmm3\n\tvmulps %%zmm2, %%zmm1, %%zmm4\n\t"                                    \
    "vcvtdq2ps %%zmm" A ", %%zmm" A "\n\tvcvtdq2ps %%zmm" B ", %%zmm" B "\n\t"                             \
    "vfmadd213ps " GEMM_ACC0(D, "0") "(%[p]), %%zmm3, %%zmm" A "\n\t"                                       \
    "vfmadd213ps " GEMM_ACC1(D, "0") "(%[p]), %%zmm4, %%zmm" B "\n\t"                                       \
    "vmovups %%zmm" A ", " GEMM_ACC0(D, "0") "(%[p])\n\tvmovups %%zmm" B ", " GEMM_ACC1(D, "0") "(%[p])\n\t"
/* A block as two INT4_GEMM_HALFs, in bytes and in one pass: a 64-byte load holds both halves' inputs
   (lanes 0..7 groups 0..7, lanes 8..15 groups 8..15); the pairs' hi and lo sums in zmm16..31 (pair (i, r):
   16 + 8 i + 2 r and the next), joined, then the float epilogue. */
#define INT4_GEMM_BYTES_BLOCK                                                                               \
    "vpxord %%zmm16, %%zmm16, %%zmm16\n\tvpxord %%zmm17, %%zmm17, %%zmm17\n\t"                             \
    "vpxord %%zmm18, %%zmm18, %%zmm18\n\tvpxord %%zmm19, %%zmm19, %%zmm19\n\t"                             \
    "vpxord %%zmm20, %%zmm20, %%zmm20\n\tvpxord %%zmm21, %%zmm21, %%zmm21\n\t"                             \
    "vpxord %%zmm22, %%zmm22, %%zmm22\n\tvpxord %%zmm23, %%zmm23, %%zmm23\n\t"                             \
    "vpxord %%zmm24, %%zmm24, %%zmm24\n\tvpxord %%zmm25, %%zmm25, %%zmm25\n\t"                             \
    "vpxord %%zmm26, %%zmm26, %%zmm26\n\tvpxord %%zmm27, %%zmm27, %%zmm27\n\t"                             \
    "vpxord %%zmm28, %%zmm28, %%zmm28\n\tvpxord %%zmm29, %%zmm29, %%zmm29\n\t"                             \
    "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31\n\t"                             \
    "xor %[o], %[o]\n\t"                                                                                   \
    "1:\n\t"                                                                                               \
    "vmovdqa64 (%[w0],%[o]), %%zmm0\n\tvmovdqa64 (%[w1],%[o]), %%zmm1\n\t"                                 \
    INT4_GEMM_BYTES_ROW("x0", "2", "3", "16", "17", "24", "25")                                            \
    INT4_GEMM_BYTES_ROW("x1", "4", "5", "18", "19", "26", "27")                                            \
    INT4_GEMM_BYTES_ROW("x2", "6", "7", "20", "21", "28", "29")                                            \
    INT4_GEMM_BYTES_ROW("x3", "8", "9", "22", "23", "30", "31")                                            \
    "add $64, %[o]\n\tcmp $512, %[o]\n\tjne 1b\n\t"                                                        \
    "vmovups (%[c]), %%zmm0\n\tvmovups 64(%[c]), %%zmm1\n\t"                                               \
    "vmovdqu32 (%[k0]), %%zmm10\n\tvmovdqu32 (%[k1]), %%zmm11\n\t"                                         \
    INT4_GEMM_BYTES_JOIN("16", "17", "10") INT4_GEMM_BYTES_JOIN("24", "25", "11")                          \
    INT4_GEMM_BYTES_PAIRS("0", "16", "24")                                                                 \
    INT4_GEMM_BYTES_JOIN("18", "19", "10") INT4_GEMM_BYTES_JOIN("26", "27", "11")                          \
    INT4_GEMM_BYTES_PAIRS("64", "18", "26")                                                                \
    INT4_GEMM_BYTES_JOIN("20", "21", "10") INT4_GEMM_BYTES_JOIN("28", "29", "11")                          \
    INT4_GEMM_BYTES_PAIRS("128", "20", "28")                                                               \
    INT4_GEMM_BYTES_JOIN("22", "23", "10") INT4_GEMM_BYTES_JOIN("30", "31", "11")                          \
    INT4_GEMM_BYTES_PAIRS("192", "22", "30")

/* int4_gemm_block in bytes: w0, w1 the block's unpacked weight bytes, x0..x3 its planes, k0, k1 the two
   weight rows' corrections of the block. */
static inline __attribute__((always_inline)) void int4_gemm_block_bytes(const uint8_t *w0, const uint8_t *w1,
        const uint8_t *x0, const uint8_t *x1, const uint8_t *x2, const uint8_t *x3, const int32_t *k0,
        const int32_t *k1, const float *c, const float *d, float *acc) {
    int64_t o;
    __asm__ volatile(INT4_GEMM_BYTES_BLOCK
                     : [o] "=&r"(o)
                     : [w0] "r"(w0), [w1] "r"(w1), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [k0] "r"(k0),
                       [k1] "r"(k1), [c] "r"(c), [d] "r"(d), [p] "r"(acc)
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                       "xmm11", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24",
                       "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "memory", "cc");
}
#endif

/* y (M x N) = the int4 product of M quantized activation rows (qx, dx, sx as quantize_row_q16 gives
   them, or on Zen 4 qx holding quantize_row_planes' byte planes; qx 64-byte aligned, a row every ldq
   int16, 2 ldq bytes); K a multiple of 512. */
static void int4_gemm(const int16_t *qx, int64_t ldq, const float *dx, const float *sx, int64_t M, int64_t K, const uint8_t *w,
                      const uint16_t *scale, const uint16_t *mins, const float *bias, float *y, int64_t N) {
    const int64_t G = K / 32, blocks = G / 16, whole = blocks * 512;
    const int64_t tiles = (N + GEMM_NT - 1) / GEMM_NT, chunks = (M + GEMM_MC - 1) / GEMM_MC;
    #pragma omp parallel
    {
#ifdef GEMM_VNNI_ORDER
        const int64_t ldb = whole + 64;  /* a tile row's bytes, not a multiple of 4 KiB: rows in different L1 sets */
        uint8_t *wbytes = (uint8_t *)aligned_alloc(64, GEMM_NT * ldb);
        int32_t *corr = (int32_t *)aligned_alloc(64, sizeof(int32_t) * GEMM_NT * blocks * 16);
#else
        const int64_t ldw = whole + 32;  /* not a multiple of 4 KiB: the tile's rows in different L1 sets */
        int16_t *wbuf = (int16_t *)aligned_alloc(64, sizeof(int16_t) * GEMM_NT * ldw);
#endif
        /* the tile's scales block by block ([block][row][16]), its mins row by row ([row][G]) */
        float *cs = (float *)aligned_alloc(64, sizeof(float) * GEMM_NT * G * 2), *ms = cs + GEMM_NT * G;
        /* [activation row / 4][weight row][activation row % 4][GEMM_PAIR] */
        float *acc = (float *)aligned_alloc(64, sizeof(float) * GEMM_MC * GEMM_NT * GEMM_PAIR);
        float dd[64] __attribute__((aligned(32)));  /* 4 activation rows' dx of a block */
        #pragma omp for schedule(dynamic, 1)  /* chunk-major: the threads share one chunk of activations */
        for (int64_t t = 0; t < tiles * chunks; t++) {
            const int64_t m0 = t / tiles * GEMM_MC, n0 = t % tiles * GEMM_NT;
            const int64_t rows = M - m0 < GEMM_MC ? M - m0 : GEMM_MC;
#ifdef GEMM_VNNI_ORDER
            int4_gemm_tile_bytes(w, scale, mins, N, K, n0, wbytes, ldb, corr, cs, ms);
#else
            int4_gemm_tile(w, scale, mins, N, K, n0, wbuf, ldw, cs, ms);
#endif
            /* the chunk's row groups ([row / 4][weight row][row % 4][GEMM_PAIR]), not the whole buffer */
            memset(acc, 0, sizeof(float) * ((rows + 3) / 4) * GEMM_NT * 4 * GEMM_PAIR);
            for (int64_t bl = 0; bl < blocks; bl++)
                for (int64_t mu = 0; mu < rows; mu += 4) {
                    const int16_t *xs[4];
                    for (int r = 0; r < 4; r++) {  /* a row past the chunk repeats its last one */
                        const int64_t m = m0 + (mu + r < rows ? mu + r : rows - 1);
                        xs[r] = qx + m * ldq + bl * 512;
                        _mm256_store_ps(dd + r * 16, _mm256_loadu_ps(dx + m * G + bl * 16));
                        _mm256_store_ps(dd + r * 16 + 8, _mm256_loadu_ps(dx + m * G + bl * 16 + 8));
                    }
                    for (int r = 0; r < 4 && mu + 4 + r < rows; r++)  /* the next rows' block, while these run */
                        for (int o = 0; o < 512; o += 32) _mm_prefetch((const char *)(xs[r] + 4 * ldq + o), _MM_HINT_T0);
                    for (int nu = 0; nu < GEMM_NT; nu += 2)
#ifdef GEMM_VNNI_ORDER  /* xs: the rows' planes of the block (its 1,024 bytes, as its int16 levels take) */
                        int4_gemm_block_bytes(wbytes + nu * ldb + bl * 512, wbytes + (nu + 1) * ldb + bl * 512,
                                              (const uint8_t *)xs[0], (const uint8_t *)xs[1], (const uint8_t *)xs[2],
                                              (const uint8_t *)xs[3], corr + (nu * blocks + bl) * 16,
                                              corr + ((nu + 1) * blocks + bl) * 16, cs + (bl * GEMM_NT + nu) * 16, dd,
                                              acc + (mu / 4 * GEMM_NT + nu) * 4 * GEMM_PAIR + GEMM_SLOT(bl));
#else
                        int4_gemm_block(wbuf + nu * ldw + bl * 512, wbuf + (nu + 1) * ldw + bl * 512, xs[0], xs[1], xs[2],
                                        xs[3], cs + (bl * GEMM_NT + nu) * 16, dd,
                                        acc + (mu / 4 * GEMM_NT + nu) * 4 * GEMM_PAIR + GEMM_SLOT(bl));
#endif
                }
#ifdef GEMM_VNNI_ORDER
            for (int i = 0; i < GEMM_NT && n0 + i < N; i++) {
                const int64_t n = n0 + i;
                for (int64_t r = 0; r < rows; r++) {
                    const float *s = sx + (m0 + r) * G, *a = acc + ((r / 4 * GEMM_NT + i) * 4 + r % 4) * GEMM_PAIR;
                    __m512 off = _mm512_setzero_ps();
                    for (int64_t bl = 0; bl < blocks; bl++)
                        off = _mm512_fmadd_ps(_mm512_loadu_ps(ms + i * G + bl * 16), _mm512_loadu_ps(s + bl * 16), off);
                    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(a + 16)),
                                               _mm512_add_ps(_mm512_load_ps(a + 32), _mm512_load_ps(a + 48)));
                    y[(m0 + r) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(sum, off)) + (bias ? bias[n] : 0.0f);
                }
            }
#else
            for (int i = 0; i < GEMM_NT && n0 + i < N; i++) {
                const int64_t n = n0 + i;
                const float b = bias ? bias[n] : 0.0f;
                __m256 v[8];
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t m = m0 + r;
                    const float *s = sx + m * G;
                    __m256 a = _mm256_load_ps(acc + ((r / 4 * GEMM_NT + i) * 4 + r % 4) * GEMM_PAIR), off = _mm256_setzero_ps();
                    for (int64_t bl = 0; bl < blocks; bl++) {
                        off = _mm256_fmadd_ps(_mm256_loadu_ps(ms + i * G + bl * 16), _mm256_loadu_ps(s + bl * 16), off);
                        off = _mm256_fmadd_ps(_mm256_loadu_ps(ms + i * G + bl * 16 + 8), _mm256_loadu_ps(s + bl * 16 + 8), off);
                    }
                    /* int4_rows_r's lane sum (0 + lane 0 + ... + lane 7, in order), for 8 rows at once */
                    v[r % 8] = _mm256_add_ps(a, off);
                    if (r % 8 < 7 && r + 1 < rows) continue;
                    const int k = (int)(r % 8) + 1;
                    for (int j = k; j < 8; j++) v[j] = _mm256_setzero_ps();
                    __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
                    __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
                    __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
                    __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
                    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
                    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
                    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
                    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
                    __m256 lane[8] = {  /* lane[j]: lane j of the 8 rows */
                        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
                    __m256 total = _mm256_setzero_ps();
                    for (int j = 0; j < 8; j++) total = _mm256_add_ps(total, lane[j]);
                    float out[8];
                    _mm256_storeu_ps(out, _mm256_add_ps(total, _mm256_set1_ps(b)));
                    for (int j = 0; j < k; j++) y[(m - k + 1 + j) * N + n] = out[j];
                }
            }
#endif
        }
        free(acc);
        free(cs);
#ifdef GEMM_VNNI_ORDER
        free(corr);
        free(wbytes);
#else
        free(wbuf);
#endif
    }
}
/* fewer rows: int4_rows, 4 activation rows at a time, was as fast or faster (AVX2 on Zen 3; on Zen 4 the byte
   GEMM, zeroing only its rows' accumulators, was slower at 4 rows, mixed at 8 and 10, and as fast or faster
   from 12 on the 1B layer's 4 products) */
#ifdef GEMM_VNNI_ORDER
#define INT4_GEMM_MIN_ROWS 12
#else
#define INT4_GEMM_MIN_ROWS 48
#endif
#define GEMM_BLAS_WEIGHTS (16 * 1024 * 1024)
#endif

/* The most rows int4_linear takes for an N x K weight; past them the batch is dequantized for the BLAS:
   64 without int4_gemm or for K not a multiple of 512; else, with AVX2, 511 for a layer under
   GEMM_BLAS_WEIGHTS weights (its float copy stays in the last-level cache, and from 512 rows the BLAS
   product of it was faster) and any number for larger layers; with AVX-512 VNNI on a Zen core any
   number (the GEMM was as fast as the BLAS or faster at every shape of the 1B geometry, 128 and 1,024
   rows); 64 with AVX-512 on other CPUs (no GEMM, above). */
int64_t int4_kernel_max_rows(int64_t N, int64_t K) {
#if defined(INT4_GEMM) && defined(GEMM_VNNI_ORDER)
    if (K % 512 == 0) return INT64_MAX;
#elif defined(INT4_GEMM)
    if (K % 512 == 0) return N * K >= GEMM_BLAS_WEIGHTS ? INT64_MAX : 511;
#endif
    return 64;
}

/* y[m, n] = sum_k x[m, k] * (scale[n, k/32] * q[n, k] + min[n, k/32]) + bias[n]; K a multiple of 32. */
void int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *scale,
                 const uint16_t *mins, const float *bias, float *y, int64_t N) {
    int64_t G = K / 32, ldq = K;
#ifdef INT4_GEMM
    const int gemm = M >= INT4_GEMM_MIN_ROWS && K % 512 == 0;
    if (gemm) ldq = K + 32;  /* not a multiple of 4 KiB: the rows of a block in different L1 sets */
#endif
    /* 64-byte aligned: the GEMM's 32-byte (AVX2) and 64-byte (Zen 4) loads never straddle two cache lines */
    int16_t *qx = (int16_t *)aligned_alloc(64, (sizeof(int16_t) * M * ldq + 127) / 64 * 64);
    float *dx = (float *)malloc(sizeof(float) * M * G * 2);
    float *sx = dx + M * G;
    #pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
#ifdef GEMM_VNNI_ORDER
        if (gemm) {  /* the byte tiles' planes */
            quantize_row_planes(x + m * K, K, (uint8_t *)(qx + m * ldq), dx + m * G, sx + m * G);
            continue;
        }
#endif
        quantize_row_q16(x + m * K, K, qx + m * ldq, dx + m * G, sx + m * G);
    }
#ifdef INT4_GEMM
    if (gemm) {
        int4_gemm(qx, ldq, dx, sx, M, K, w, scale, mins, bias, y, N);
        free(dx);
        free(qx);
        return;
    }
#endif
    #pragma omp parallel for schedule(dynamic, 64)  /* a descheduled thread holds up one chunk, not its share */
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * (K / 2);
        int4_prefetch(wr, K);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = (int)(M - m0 < 4 ? M - m0 : 4);
            float out[4];
            int4_rows(wr, scale + n * G, mins + n * G, G, qx + m0 * K, dx + m0 * G, sx + m0 * G, K, R, out);
            for (int r = 0; r < R; r++) y[(m0 + r) * N + n] = out[r] + (bias ? bias[n] : 0.0f);
        }
    }
    free(dx);
    free(qx);
}

/* out[n, k] = scale[n, k/32] * q[n, k] + min[n, k/32] (float32), for the batched (prefill) product. */
void int4_dequantize(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, float *out, int64_t N,
                     int64_t K) {
    int64_t G = K / 32, whole = K / 512 * 512;
    #pragma omp parallel for schedule(static) if (N * K >= 65536)  /* a few rows (an embedding lookup): no fork */
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * (K / 2);
        float *o = out + n * K;
        float s[16], m[16];
        for (int64_t bl = 0; bl < whole / 512; bl++) {
            const uint8_t *wb = wr + bl * 256;
            float *ob = o + bl * 512;
            for (int l = 0; l < 16; l++) {
                s[l] = half_to_float(scale[n * G + bl * 16 + l]);
                m[l] = half_to_float(mins[n * G + bl * 16 + l]);
            }
            for (int ch = 0; ch < 8; ch++)
                for (int l = 0; l < 16; l++)
                    for (int e = 0; e < 2; e++) {
                        uint8_t byte = wb[ch * 32 + 2 * l + e];
                        ob[l * 32 + 4 * ch + e] = s[l] * (float)(byte & 0x0f) + m[l];
                        ob[l * 32 + 4 * ch + 2 + e] = s[l] * (float)(byte >> 4) + m[l];
                    }
        }
        for (int64_t b = whole / 2; b < K / 2; b++) {
            int64_t lo, hi;
            int4_inputs(b, K, &lo, &hi);
            o[lo] = half_to_float(scale[n * G + lo / 32]) * (float)(wr[b] & 0x0f) + half_to_float(mins[n * G + lo / 32]);
            o[hi] = half_to_float(scale[n * G + hi / 32]) * (float)(wr[b] >> 4) + half_to_float(mins[n * G + hi / 32]);
        }
    }
}
"""
