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

/* Rows 8 KiB ahead of this one, while it is summed (measured: ~1.5x the bandwidth of no prefetch). */
static inline void int4_prefetch(const uint8_t *row, int64_t K) {
    for (int64_t o = 0; o < K / 2; o += 64) __builtin_prefetch(row + 8192 + o, 0, 3);
}

static void quantize_row_q16(const float *x, int64_t K, int16_t *qx, float *dx, float *sx) {
    for (int64_t g = 0; g < K / 32; g++) {
        const float *xb = x + g * 32;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
            sum += xb[j];
        }
        float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int j = 0; j < 32; j++) qx[qx_index(g * 32 + j, K)] = (int16_t)nearbyintf(xb[j] * id);
        dx[g] = amax / 32767.0f;
        sx[g] = sum;
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

/* y[m, n] = sum_k x[m, k] * (scale[n, k/32] * q[n, k] + min[n, k/32]) + bias[n]; K a multiple of 32. */
void int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *scale,
                 const uint16_t *mins, const float *bias, float *y, int64_t N) {
    int64_t G = K / 32;
    int16_t *qx = (int16_t *)malloc(sizeof(int16_t) * M * K + 64);
    float *dx = (float *)malloc(sizeof(float) * M * G * 2);
    float *sx = dx + M * G;
    for (int64_t m = 0; m < M; m++) quantize_row_q16(x + m * K, K, qx + m * K, dx + m * G, sx + m * G);
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
