"""One whole decode step of a llama-family model with quantized weights, as one native call.

A batch-1 decode step is ~120 small products; called one by one from Python, each pays the call,
the tensor allocations and an OpenMP fork and join, which together cost more than the products on a
small model. Here the threads enter one parallel region per step and take chunks of output rows
from a queue of the step's own (five phases per layer), not a static split with OpenMP barriers: a
thread the OS deschedules holds up at most the one chunk it took, where a barrier waits for its whole
share, and a thread with nothing left spins for at most ``SPIN_NS`` and then sleeps on a futex
(libgomp's barrier spins for milliseconds before it sleeps unless OMP_WAIT_POLICY=PASSIVE, holding
the core the thread it waits for needs). On a loaded machine the old step at 2 threads ran an 8B
model slower than at 1.

The model is described once, at load, by a plan: int64 words (pointers and sizes) laid out as
``PLAN_HEADER`` then ``LAYER_WORDS`` per layer; see ``plan_words`` in ``models/native_decode.py``.
"""

from __future__ import annotations

PLAN_HEADER = 9  # num_layers, H, Hkv, D, hidden, inter, final_norm, spin ns, KV kind (cpu_kernels.kv_kind)
SPIN_NS = 20_000  # how long a thread with no chunk to take spins before it sleeps
LINEAR_WORDS = 7  # format (4, 8 or GGUF_FORMAT), data, scale, min, bias, rows N, cols K
GGUF_FORMAT = 16  # GGUF blocks (ops/cpu_gguf.c): scale = the row segments, min = their number
LAYER_WORDS = 4 * LINEAR_WORDS + 9  # qkv, o, gate_up, down; norms, caches, rope tables, window

SOURCE = r"""
#include <omp.h>
#include <limits.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

typedef struct { int64_t fmt, w, scale, min, bias, N, K; } lin_t;
typedef struct {
    lin_t qkv, o, gate_up, down;
    int64_t input_norm, post_norm, q_norm, k_norm, k_cache, v_cache, cos, sin, window;
} layer_t;
typedef struct { int64_t L, H, Hkv, D, hidden, inter, final_norm, spin_ns, kv_kind; } head_t;

/* Activations for the int4 products (in the kernel's order) or the GGUF ones (natural order): rows
   quantized per block of 32. */
typedef struct { int16_t *qx; float *dx, *sx; } qact_t;

/* The input rows x [B, K] of product l, quantized as its kernel reads them (int8: float, as they are). */
static void quantize_rows(const lin_t *l, const float *x, int64_t B, int64_t K, qact_t *q) {
    if (l->fmt == 16) gguf_quantize_rows(x, B, K, q->qx, q->dx, q->sx);
    if (l->fmt != 4) return;
    for (int64_t m = 0; m < B; m++)
        quantize_row_q16(x + m * K, K, q->qx + m * K, q->dx + m * (K / 32), q->sx + m * (K / 32));
}

/* y[m, n] for n in [lo, hi) of one product; x float rows [B, K] (int8) or their quantized copy (int4). */
static void linear_rows(const lin_t *l, const float *x, const qact_t *q, int64_t B, float *y, int64_t ldy,
                        int64_t lo, int64_t hi) {
    int64_t K = l->K, N = l->N;
    const float *bias = (const float *)l->bias;
    if (l->fmt == 16) {
        gguf_rows((const uint8_t *)l->w, (const int64_t *)l->scale, l->min, K, q->qx, q->dx, q->sx, B, bias, y, ldy,
                  lo, hi);
        return;
    }
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

/* The step's work queue. A step is a sequence of phases (five per layer: qkv and rope by head,
   attention by KV head, o, gate_up with SiLU, down, each in chunks of output rows); a thread claims the
   next chunk of the current phase, and whoever finishes a phase's last chunk does the short serial
   work after it (residual add, norm, activation quantization) and opens the next phase. */
typedef struct {
    uint64_t word;  /* phase << 32 | next unclaimed chunk */
    int64_t done;   /* chunks of the phase finished */
    int phase;      /* futex word: the open phase, for sleepers */
    int sleepers;
    int64_t spin_ns;
} queue_t;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Returns once phase p is no longer open (spins for up to spin_ns, then sleeps). */
static void queue_wait(queue_t *qu, int p) {
    int64_t until = 0;
    for (int i = 1; __atomic_load_n(&qu->phase, __ATOMIC_ACQUIRE) == p; i++) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        if ((i & 63) == 0) {
            int64_t t = now_ns();
            if (until == 0) until = t + qu->spin_ns;
            else if (t >= until) break;
        }
    }
    while (__atomic_load_n(&qu->phase, __ATOMIC_ACQUIRE) == p) {
        __atomic_add_fetch(&qu->sleepers, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &qu->phase, FUTEX_WAIT_PRIVATE, p, NULL, NULL, 0);
        __atomic_sub_fetch(&qu->sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

static void queue_open(queue_t *qu, int p) {
    __atomic_store_n(&qu->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&qu->word, (uint64_t)p << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&qu->phase, p, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&qu->sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &qu->phase, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

enum { PH_QKV, PH_ATTN, PH_O, PH_GATE_UP, PH_DOWN, PH_PER_LAYER };
#define CHUNK_ROWS 64  /* output rows per chunk of o, gate_up (gate rows) and down */

typedef struct {
    const head_t *hd;
    const layer_t *layers;
    int64_t B, width, max_blocks, block_size;
    int64_t attn_heads, attn_parts;  /* query heads a chunk of attention takes; chunks per KV head */
    const int64_t *positions, *slots, *tables, *context_lens;
    float eps, attn_scale;
    float *x, *h, *qkv, *attn, *delta, *act, *out;
    qact_t q;
} step_t;

static int64_t phase_chunks(const step_t *st, int p) {
    const head_t *hd = st->hd;
    switch (p % PH_PER_LAYER) {
        case PH_QKV: return hd->H + 2 * hd->Hkv;
        case PH_ATTN: return st->B * hd->Hkv * st->attn_parts;
        case PH_GATE_UP: return (hd->inter + CHUNK_ROWS - 1) / CHUNK_ROWS;
        default: return (hd->hidden + CHUNK_ROWS - 1) / CHUNK_ROWS;
    }
}

/* Chunk c of phase p. scores: min(H / Hkv, 8) * max_ctx floats; g: B * 2 * inter floats (the thread's own). */
static void run_chunk(const step_t *st, int p, int64_t c, float *scores, float *g) {
    const head_t *hd = st->hd;
    const layer_t *ly = &st->layers[p / PH_PER_LAYER];
    int64_t H = hd->H, Hkv = hd->Hkv, D = hd->D, B = st->B, width = st->width, inter = hd->inter;
    int64_t lo = c * CHUNK_ROWS, hi;
    switch (p % PH_PER_LAYER) {
        case PH_QKV:
            linear_rows(&ly->qkv, st->h, &st->q, B, st->qkv, width, c * D, (c + 1) * D);
            for (int64_t b = 0; b < B; b++) {
                const float *cos = (const float *)ly->cos + st->positions[b] * D;
                const float *sin = (const float *)ly->sin + st->positions[b] * D;
                float *v = st->qkv + b * width + c * D;
                int64_t slot = st->slots[b];
                if (c < H) {
                    head_norm_rope(v, (const float *)ly->q_norm, cos, sin, D, st->eps);
                } else if (c < H + Hkv) {
                    head_norm_rope(v, (const float *)ly->k_norm, cos, sin, D, st->eps);
                    kv_store((void *)ly->k_cache, slot * Hkv + c - H, v, D, (int)hd->kv_kind);
                } else {
                    kv_store((void *)ly->v_cache, slot * Hkv + c - H - Hkv, v, D, (int)hd->kv_kind);
                }
            }
            return;
        case PH_ATTN: {  /* one KV head and (some of) the query heads that share it */
            int64_t parts = st->attn_parts, S = st->attn_heads, G = H / Hkv;
            int64_t b = c / (Hkv * parts), kvh = c / parts % Hkv, part = c % parts, h0 = kvh * G + part * S;
            int64_t n = G - part * S < S ? G - part * S : S;
            attend_group(st->qkv + b * width + h0 * D, n, (const void *)ly->k_cache, (const void *)ly->v_cache,
                         st->tables + b * st->max_blocks, st->context_lens[b], ly->window, Hkv, kvh, D,
                         st->block_size, st->attn_scale, scores, st->attn + (b * H + h0) * D, (int)hd->kv_kind);
            return;
        }
        case PH_O:
            hi = lo + CHUNK_ROWS < hd->hidden ? lo + CHUNK_ROWS : hd->hidden;
            linear_rows(&ly->o, st->attn, &st->q, B, st->delta, hd->hidden, lo, hi);
            return;
        case PH_GATE_UP:
            hi = lo + CHUNK_ROWS < inter ? lo + CHUNK_ROWS : inter;
            linear_rows(&ly->gate_up, st->h, &st->q, B, g, 2 * inter, lo, hi);
            linear_rows(&ly->gate_up, st->h, &st->q, B, g, 2 * inter, inter + lo, inter + hi);
            for (int64_t m = 0; m < B; m++)
                for (int64_t j = lo; j < hi; j++) {
                    float a = g[m * 2 * inter + j], u = g[m * 2 * inter + inter + j];
                    st->act[m * inter + j] = a / (1.0f + expf(-a)) * u;
                }
            return;
        default:
            hi = lo + CHUNK_ROWS < hd->hidden ? lo + CHUNK_ROWS : hd->hidden;
            linear_rows(&ly->down, st->act, &st->q, B, st->delta, hd->hidden, lo, hi);
    }
}

/* Input of layer i's first product (i == L: the final norm, into out). */
static void layer_input(step_t *st, int64_t i) {
    const head_t *hd = st->hd;
    if (i == hd->L) {
        norm_rows(st->x, (const float *)hd->final_norm, st->out, st->B, hd->hidden, st->eps);
        return;
    }
    norm_rows(st->x, (const float *)st->layers[i].input_norm, st->h, st->B, hd->hidden, st->eps);
    quantize_rows(&st->layers[i].qkv, st->h, st->B, hd->hidden, &st->q);
}

/* The serial work after phase p, by the thread that finished its last chunk. */
static void after_phase(step_t *st, int p) {
    const head_t *hd = st->hd;
    int64_t i = p / PH_PER_LAYER, B = st->B;
    const layer_t *ly = &st->layers[i];
    qact_t *q = &st->q;
    switch (p % PH_PER_LAYER) {
        case PH_ATTN:
            quantize_rows(&ly->o, st->attn, B, hd->H * hd->D, q);
            return;
        case PH_O:
            add_rows(st->x, st->delta, B * hd->hidden);
            norm_rows(st->x, (const float *)ly->post_norm, st->h, B, hd->hidden, st->eps);
            quantize_rows(&ly->gate_up, st->h, B, hd->hidden, q);
            return;
        case PH_GATE_UP:
            quantize_rows(&ly->down, st->act, B, hd->inter, q);
            return;
        case PH_DOWN:
            add_rows(st->x, st->delta, B * hd->hidden);
            layer_input(st, i + 1);
            return;
        default:
            return;
    }
}

/* x_in: [B, hidden] embedded tokens; out: [B, hidden] final-normed hidden states. */
void llama_decode_step(const int64_t *plan, const float *x_in, int64_t B, const int64_t *positions,
                       const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *context_lens,
                       int64_t block_size, float eps, float attn_scale, float *out) {
    const head_t *hd = (const head_t *)plan;
    int64_t H = hd->H, Hkv = hd->Hkv, D = hd->D, hidden = hd->hidden, inter = hd->inter;
    int64_t width = (H + 2 * Hkv) * D, max_ctx = 1;
    for (int64_t b = 0; b < B; b++) max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
    int64_t wide = hidden > H * D ? hidden : H * D;
    wide = wide > inter ? wide : inter;
    float *buf = (float *)malloc(sizeof(float) * B * (2 * hidden + wide + width + H * D + inter + wide / 16));
    int64_t attn_heads = attention_split(B, Hkv, H / Hkv, omp_get_max_threads());
    step_t st = {hd, (const layer_t *)(plan + 9), B, width, max_blocks, block_size, attn_heads,
                 (H / Hkv + attn_heads - 1) / attn_heads, positions, slots, tables, context_lens, eps, attn_scale};
    st.x = buf;
    st.h = st.x + B * hidden;
    st.qkv = st.h + B * wide;
    st.attn = st.qkv + B * width;
    st.delta = st.attn + B * H * D;
    st.act = st.delta + B * hidden;
    st.q.dx = st.act + B * inter;
    st.q.sx = st.q.dx + B * wide / 32;
    st.q.qx = (int16_t *)malloc(sizeof(int16_t) * B * wide);
    st.out = out;
    memcpy(st.x, x_in, sizeof(float) * B * hidden);
    layer_input(&st, 0);
    int last = (int)(hd->L * PH_PER_LAYER);
    queue_t qu = {0, 0, 0, 0, hd->spin_ns};
    #pragma omp parallel
    {
        int64_t group = H / Hkv < 8 ? H / Hkv : 8;
        float *scores = (float *)malloc(sizeof(float) * (group * max_ctx + B * 2 * inter));
        float *g = scores + group * max_ctx;
        for (;;) {
            uint64_t word = __atomic_load_n(&qu.word, __ATOMIC_ACQUIRE);
            int p = (int)(word >> 32);
            if (p == last) break;
            int64_t c = (int64_t)(word & 0xffffffffu), n = phase_chunks(&st, p);
            if (c >= n) {
                queue_wait(&qu, p);
                continue;
            }
            if (!__atomic_compare_exchange_n(&qu.word, &word, word + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                continue;
            run_chunk(&st, p, c, scores, g);
            if (__atomic_add_fetch(&qu.done, 1, __ATOMIC_ACQ_REL) == n) {
                after_phase(&st, p);
                queue_open(&qu, p + 1);
            }
        }
        free(scores);
    }
    free(st.q.qx);
    free(buf);
}
"""
