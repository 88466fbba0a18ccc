/* Products and dequantization over GGUF blocks as the file holds them: Q8_0, Q4_K, Q5_K, Q6_K.
   Compiled with the kernels of cpu_kernels.py (it provides half_to_float, hsum8 and the includes).

   A "gguf" weight is rows of blocks in segments (a fused q/k/v may hold Q4_K rows and Q6_K rows):
   segment s is int64 words {rows, ggml type, cols, row bytes, byte offset}. Activations are
   quantized to int16 in their natural order, one scale per 256 inputs (dx = max|x| / 32767; the
   last, shorter chunk its own) with the float sum of each group of 32 (sx), so that a super-block's
   product is an integer sum with the sub-block scales folded into the weights:
     Q8_0:       d dx sum q x                            (q int8, per block of 32)
     Q4_K, Q5_K: d dx sum_s sc_s sum q x - dmin sum_s m_s sx_s   (q 0..15 / 0..31; 6-bit sc, m per 32)
     Q6_K:       d dx sum_s sc_s sum q x                 (q -32..31; int8 sc per 16)
   (int16 keeps ~15 bits of each chunk's largest input; llama.cpp's Q8_K keeps 8 per 256.) */

enum { GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14 };
#define SEG_WORDS 5

static void quantize_row_q16_natural(const float *x, int64_t K, int16_t *qx, float *dx, float *sx) {
    for (int64_t c = 0; c < K; c += 256) {
        int64_t n = K - c < 256 ? K - c : 256;
        float amax = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float a = fabsf(x[c + j]);
            amax = a > amax ? a : amax;
        }
        float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int64_t j = 0; j < n; j++) qx[c + j] = (int16_t)nearbyintf(x[c + j] * id);
        dx[c / 256] = amax / 32767.0f;
    }
    for (int64_t g = 0; g < K / 32; g++) {
        float sum = 0.0f;
        for (int j = 0; j < 32; j++) sum += x[g * 32 + j];
        sx[g] = sum;
    }
}

static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline int32_t isum16(const int16_t *a, const int16_t *b, int n) {
    int32_t s = 0;
    #pragma omp simd reduction(+:s)
    for (int i = 0; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* One 256-input super-block (or a 32-input Q8_0 block) unpacked: q[] integers and, per sub-block of
   16 inputs, the float weight of its integer sum (scale16) and per group of 32 the min (min32). */
typedef struct {
    int16_t q[256];
    float scale16[16], min32[8];
    int n;  /* inputs: 256 or 32 */
} unpacked_t;

static void unpack_block(int64_t type, const uint8_t *b, unpacked_t *u) {
    if (type == GGUF_Q8_0) {
        float d = half_to_float((uint16_t)(b[0] | b[1] << 8));
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int l = 0; l < 32; l++) u->q[l] = qs[l];
        u->scale16[0] = u->scale16[1] = d;
        u->min32[0] = 0.0f;
        u->n = 32;
        return;
    }
    u->n = 256;
    if (type == GGUF_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = half_to_float((uint16_t)(b[208] | b[209] << 8));
        for (int n = 0; n < 2; n++) {
            int16_t *y = u->q + n * 128;
            for (int l = 0; l < 32; l++) {
                y[l] = (int16_t)(((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = (int16_t)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (int16_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (int16_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
            for (int i = 0; i < 8; i++) u->scale16[n * 8 + i] = d * (float)sc[n * 8 + i];
            ql += 64;
            qh += 32;
        }
        for (int g = 0; g < 8; g++) u->min32[g] = 0.0f;
        return;
    }
    /* Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of 5th bits), nibbles */
    float d = half_to_float((uint16_t)(b[0] | b[1] << 8)), dmin = half_to_float((uint16_t)(b[2] | b[3] << 8));
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = type == GGUF_Q5_K ? b + 48 : b + 16;
    for (int j = 0; j < 4; j++) {
        int16_t *y = u->q + j * 64;
        for (int l = 0; l < 32; l++) {
            y[l] = (int16_t)(ql[l] & 0x0f);
            y[l + 32] = (int16_t)(ql[l] >> 4);
        }
        if (type == GGUF_Q5_K)
            for (int l = 0; l < 32; l++) {
                y[l] |= (int16_t)(((qh[l] >> (2 * j)) & 1) << 4);
                y[l + 32] |= (int16_t)(((qh[l] >> (2 * j + 1)) & 1) << 4);
            }
        ql += 32;
    }
    for (int s = 0; s < 8; s++) {
        int sc, m;
        k_scale_min(s, scales, &sc, &m);
        u->scale16[2 * s] = u->scale16[2 * s + 1] = d * (float)sc;
        u->min32[s] = dmin * (float)m;
    }
}

static int64_t block_bytes(int64_t type) {
    switch (type) {
        case GGUF_Q8_0: return 34;
        case GGUF_Q4_K: return 144;
        case GGUF_Q5_K: return 176;
        default: return 210;
    }
}

/* Row n of a segmented weight: its bytes, type and (through *cols) the input count. */
static const uint8_t *gguf_row(const uint8_t *data, const int64_t *segs, int64_t nsegs, int64_t n, int64_t *type) {
    for (int64_t s = 0; s < nsegs; s++) {
        const int64_t *sg = segs + s * SEG_WORDS;
        if (n < sg[0] || s == nsegs - 1) {
            *type = sg[1];
            return data + sg[4] + n * sg[3];
        }
        n -= sg[0];
    }
    return data;
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* AVX2: the unpacked integers (16 per vector) times the int16 activations by vpmaddwd; each group's
   8-lane sum is scaled (weight scale x activation scale) into a float accumulator per row. */
static inline __m256i madd16(__m128i q8, int sign, const int16_t *x) {
    __m256i q = sign ? _mm256_cvtepi8_epi16(q8) : _mm256_cvtepu8_epi16(q8);
    return _mm256_madd_epi16(q, _mm256_loadu_si256((const __m256i *)x));
}

static inline float f16_at(const uint8_t *b) { return half_to_float((uint16_t)(b[0] | b[1] << 8)); }

/* The int16 weights of 32 inputs (bytes of v, times the sub-block scales) into a row's int32 sums. */
#define SCALED16(v, sign, s_lo, s_hi, out0, out1)                                                     \
    {                                                                                                 \
        __m128i b0 = _mm256_castsi256_si128(v), b1 = _mm256_extracti128_si256(v, 1);                  \
        out0 = _mm256_mullo_epi16(sign ? _mm256_cvtepi8_epi16(b0) : _mm256_cvtepu8_epi16(b0),         \
                                  _mm256_set1_epi16((int16_t)(s_lo)));                                \
        out1 = _mm256_mullo_epi16(sign ? _mm256_cvtepi8_epi16(b1) : _mm256_cvtepu8_epi16(b1),         \
                                  _mm256_set1_epi16((int16_t)(s_hi)));                                \
    }

static inline __m256i madd_at(__m256i w, const int16_t *x) {
    return _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)x));
}

/* Q8_0 block b (scale, then 32 int8) against R activation rows xg (K apart): into[r] += its scaled sum. */
static inline __attribute__((always_inline)) void q8_0_block(const uint8_t *b, const int16_t *xg, int64_t K,
                                                             const int R, __m256 *into) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(b + 2));
    __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
    const __m256 d = _mm256_set1_ps(f16_at(b));
    for (int r = 0; r < R; r++) {
        __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(madd_at(w0, xg + r * K), madd_at(w1, xg + r * K + 16)));
        into[r] = _mm256_fmadd_ps(s, d, into[r]);
    }
}

static inline __attribute__((always_inline)) void gguf_row_dot_r(const uint8_t *w, int64_t type, int64_t K,
        const int16_t *qx, const float *dx, const float *sx, const int R, float *out) {
    int64_t G = K / 32;
    __m256 acc[4], off[4];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03);
    if (type == GGUF_Q8_0) {
        /* the 8 blocks of one activation scale (256 inputs) sum into even[r] / odd[r] (two chains, so
           that a block's FMA does not wait for the previous block's) with their own scales d, then dx
           applies once */
        for (int64_t c = 0; c < G; c += 8) {
            const int64_t end = c + 8 < G ? c + 8 : G;
            __m256 even[4], odd[4];
            for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
            for (int64_t g = c; g < end; g += 2) {
                q8_0_block(w + g * 34, qx + g * 32, K, R, even);
                if (g + 1 < end) q8_0_block(w + (g + 1) * 34, qx + (g + 1) * 32, K, R, odd);
            }
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_add_ps(even[r], odd[r]), _mm256_set1_ps(dx[r * G + c / 8]), acc[r]);
        }
    } else if (type == GGUF_Q6_K) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = w + sb * 210, *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = f16_at(b + 208);
            const __m256i m32 = _mm256_set1_epi8(32);
            for (int n = 0; n < 2; n++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + n * 64));
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + n * 64 + 32));
                __m256i h = _mm256_loadu_si256((const __m256i *)(qh + n * 32));
                __m256i v[4], ws[8];
                v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
                v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
                v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
                v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
                for (int i = 0; i < 4; i++) {
                    __m256i vi = _mm256_sub_epi8(v[i], m32);
                    SCALED16(vi, 1, sc[n * 8 + 2 * i], sc[n * 8 + 2 * i + 1], ws[2 * i], ws[2 * i + 1])
                }
                for (int r = 0; r < R; r++) {  /* |q sc| <= 4096: 8 x 2 x 4096 x 32767 < 2^31 */
                    const int16_t *xh = qx + r * K + sb * 256 + n * 128;
                    __m256i s = _mm256_setzero_si256();
                    for (int i = 0; i < 8; i++) s = _mm256_add_epi32(s, madd_at(ws[i], xh + 16 * i));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * dx[r * G + sb]), acc[r]);
                }
            }
        }
    } else {  /* Q4_K, Q5_K: |q sc| <= 31 * 63, so a super-block's sums fit int32 lanes */
        int five = type == GGUF_Q5_K;
        int64_t bytes = five ? 176 : 144;
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = w + sb * bytes, *scales = b + 4, *ql = b + (five ? 48 : 16);
            float d = f16_at(b), dmin = f16_at(b + 2);
            /* bytes widened to int16 first, then split: nibble l of byte l is input l, its high nibble 32 + l */
            __m256i h0 = _mm256_setzero_si256(), h1 = h0;
            if (five) {
                h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 16)));
                h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 32)));
            }
            const __m256i n4 = _mm256_set1_epi16(0x0f), n1 = _mm256_set1_epi16(1);
            /* the 8 scales and 8 mins at once: bytes 0..7 and 8..15 of u (k_scale_min for all j) */
            uint32_t u[4];
            memcpy(u, scales, 12);
            u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
            uint32_t m03 = u[1] & 0x3f3f3f3f;
            u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
            u[2] = m03;
            u[0] &= 0x3f3f3f3f;
            const uint8_t *scb = (const uint8_t *)u;
            __m256 mv = _mm256_mul_ps(_mm256_set1_ps(dmin),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scb + 8)))));
            __m256i si[4];
            for (int r = 0; r < R; r++) si[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {  /* 64 inputs: 4 vectors of scaled weights, into each row's sums */
                __m256i q0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(ql + j * 32)));
                __m256i q1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(ql + j * 32 + 16)));
                __m256i wa = _mm256_and_si256(q0, n4), wc = _mm256_and_si256(q1, n4);  /* inputs 0..15, 16..31 */
                __m256i wb = _mm256_srli_epi16(q0, 4), wd = _mm256_srli_epi16(q1, 4);    /* inputs 32..47, 48..63 */
                if (five) {
                    __m128i lo = _mm_cvtsi32_si128(2 * j), hi = _mm_cvtsi32_si128(2 * j + 1);
                    wa = _mm256_or_si256(wa, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, lo), n1), 4));
                    wc = _mm256_or_si256(wc, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, lo), n1), 4));
                    wb = _mm256_or_si256(wb, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, hi), n1), 4));
                    wd = _mm256_or_si256(wd, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, hi), n1), 4));
                }
                __m256i s0 = _mm256_set1_epi16((int16_t)scb[2 * j]), s1 = _mm256_set1_epi16((int16_t)scb[2 * j + 1]);
                __m256i ws[4] = {_mm256_mullo_epi16(wa, s0), _mm256_mullo_epi16(wc, s0), _mm256_mullo_epi16(wb, s1),
                                 _mm256_mullo_epi16(wd, s1)};
                for (int r = 0; r < R; r++) {
                    const int16_t *xs = qx + r * K + sb * 256 + j * 64;
                    __m256i t = _mm256_add_epi32(madd_at(ws[0], xs), madd_at(ws[1], xs + 16));
                    t = _mm256_add_epi32(t, _mm256_add_epi32(madd_at(ws[2], xs + 32), madd_at(ws[3], xs + 48)));
                    si[r] = _mm256_add_epi32(si[r], t);
                }
            }
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[r]), _mm256_set1_ps(d * dx[r * G + sb]), acc[r]);
                off[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + r * G + sb * 8), off[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - hsum8(off[r]);
}

static void gguf_row_dot(const uint8_t *w, int64_t type, int64_t K, const int16_t *qx, const float *dx,
                         const float *sx, int R, float *out) {
    switch (R) {
        case 1: gguf_row_dot_r(w, type, K, qx, dx, sx, 1, out); break;
        case 2: gguf_row_dot_r(w, type, K, qx, dx, sx, 2, out); break;
        case 3: gguf_row_dot_r(w, type, K, qx, dx, sx, 3, out); break;
        default: gguf_row_dot_r(w, type, K, qx, dx, sx, 4, out); break;
    }
}
#else
/* out[r] = sum_k x[r, k] w[k] for R activation rows (quantized: qx [R, K], dx and sx [R, K / 32]). */
static void gguf_row_dot(const uint8_t *w, int64_t type, int64_t K, const int16_t *qx, const float *dx,
                         const float *sx, int R, float *out) {
    int64_t G = K / 32, bytes = block_bytes(type);
    unpacked_t u;
    for (int r = 0; r < R; r++) out[r] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += u.n) {
        unpack_block(type, w + (k0 / (type == GGUF_Q8_0 ? 32 : 256)) * bytes, &u);
        for (int r = 0; r < R; r++) {
            const int16_t *xr = qx + r * K + k0;
            const float *s = sx + r * G + k0 / 32;
            float acc = 0.0f, d = dx[r * G + k0 / 256];
            for (int g = 0; g < u.n / 32; g++) {
                float lo = (float)isum16(u.q + g * 32, xr + g * 32, 16) * u.scale16[2 * g];
                float hi = (float)isum16(u.q + g * 32 + 16, xr + g * 32 + 16, 16) * u.scale16[2 * g + 1];
                acc += (lo + hi) * d - u.min32[g] * s[g];
            }
            out[r] += acc;
        }
    }
}

#endif

static void gguf_quantize_rows(const float *x, int64_t M, int64_t K, int16_t *qx, float *dx, float *sx) {
    for (int64_t m = 0; m < M; m++)
        quantize_row_q16_natural(x + m * K, K, qx + m * K, dx + m * (K / 32), sx + m * (K / 32));
}

/* y[m, n] for n in [lo, hi): rows of a segmented weight times quantized activations. */
static void gguf_rows(const uint8_t *data, const int64_t *segs, int64_t nsegs, int64_t K, const int16_t *qx,
                      const float *dx, const float *sx, int64_t M, const float *bias, float *y, int64_t ldy,
                      int64_t lo, int64_t hi) {
    int64_t G = K / 32;
    for (int64_t n = lo; n < hi; n++) {
        int64_t type = 0;
        const uint8_t *w = gguf_row(data, segs, nsegs, n, &type);
#if !WEIGHT_PREFETCH_FAR  /* on Zen 4 these rows ran fastest with none (1B decode, its Q8_0 output: none 17.0 ->
                            18.5 tok/s at 1 thread against 8 KiB ahead; 64 KiB ahead into L2 21.4 -> 20.3, 30.7 -> 28.2 at 2) */
        weight_prefetch(w, K / (type == GGUF_Q8_0 ? 32 : 256) * block_bytes(type));  /* as int4_prefetch */
#endif
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = (int)(M - m0 < 4 ? M - m0 : 4);
            float out[4];
            gguf_row_dot(w, type, K, qx + m0 * K, dx + m0 * G, sx + m0 * G, R, out);
            for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = out[r] + (bias ? bias[n] : 0.0f);
        }
    }
}

/* y [M, N] = x [M, K] times the segmented weight's rows (+ bias). */
void gguf_linear(const float *x, int64_t M, int64_t K, const uint8_t *data, const int64_t *segs, int64_t nsegs,
                 const float *bias, float *y, int64_t N) {
    int64_t G = K / 32;
    int16_t *qx = (int16_t *)malloc(sizeof(int16_t) * M * K + 64);
    float *dx = (float *)malloc(sizeof(float) * M * G * 2 + 64);
    float *sx = dx + M * G;
    gguf_quantize_rows(x, M, K, qx, dx, sx);
    int64_t chunks = (N + 15) / 16;
    #pragma omp parallel for schedule(dynamic, 4)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t hi = c * 16 + 16 < N ? c * 16 + 16 : N;
        gguf_rows(data, segs, nsegs, K, qx, dx, sx, M, bias, y, N, c * 16, hi);
    }
    free(dx);
    free(qx);
}

/* out [N, K] float32: the rows dequantized as ggml does (value = scale * q - min). */
void gguf_dequantize(const uint8_t *data, const int64_t *segs, int64_t nsegs, float *out, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static) if (N * K >= 65536)  /* a few rows (an embedding lookup): no fork */
    for (int64_t n = 0; n < N; n++) {
        int64_t type = 0;
        const uint8_t *w = gguf_row(data, segs, nsegs, n, &type);
        unpacked_t u;
        for (int64_t k0 = 0; k0 < K; k0 += u.n) {
            unpack_block(type, w + (k0 / (type == GGUF_Q8_0 ? 32 : 256)) * block_bytes(type), &u);
            for (int i = 0; i < u.n; i++) out[n * K + k0 + i] = u.scale16[i / 16] * (float)u.q[i] - u.min32[i / 32];
        }
    }
}
