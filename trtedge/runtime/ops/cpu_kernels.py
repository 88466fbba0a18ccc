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
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("trtedge")

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static float dot_scalar(const float *x, const int8_t *w, int64_t from, int64_t K) {
    float acc = 0.0f;
    for (int64_t k = from; k < K; k++) acc += x[k] * (float)w[k];
    return acc;
}

#ifdef __AVX512F__
static inline __m512 widen(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Four weight rows against one activation row: each x load feeds four FMAs. */
static void dot4(const float *x, const int8_t *w, int64_t K, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv = _mm512_loadu_ps(x + k);
        a0 = _mm512_fmadd_ps(xv, widen(w + k), a0);
        a1 = _mm512_fmadd_ps(xv, widen(w + K + k), a1);
        a2 = _mm512_fmadd_ps(xv, widen(w + 2 * K + k), a2);
        a3 = _mm512_fmadd_ps(xv, widen(w + 3 * K + k), a3);
    }
    out[0] = _mm512_reduce_add_ps(a0) + dot_scalar(x, w, k, K);
    out[1] = _mm512_reduce_add_ps(a1) + dot_scalar(x, w + K, k, K);
    out[2] = _mm512_reduce_add_ps(a2) + dot_scalar(x, w + 2 * K, k, K);
    out[3] = _mm512_reduce_add_ps(a3) + dot_scalar(x, w + 3 * K, k, K);
}
#else
static void dot4(const float *x, const int8_t *w, int64_t K, float *out) {
    for (int r = 0; r < 4; r++) out[r] = dot_scalar(x, w + r * K, 0, K);
}
#endif

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n]   (w int8, row-major [N, K]) */
void int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale,
                 const float *bias, float *y, int64_t N) {
    int64_t groups = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * 4;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc[4];
            if (n0 + 4 <= N) {
                dot4(xm, w + n0 * K, K, acc);
            } else {
                for (int64_t n = n0; n < N; n++) acc[n - n0] = dot_scalar(xm, w + n * K, 0, K);
            }
            for (int64_t n = n0; n < n0 + 4 && n < N; n++)
                y[m * N + n] = acc[n - n0] * scale[n] + (bias ? bias[n] : 0.0f);
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _kernel_dir() -> Path:
    from trtedge.runtime.checkpoint import default_cache_dir

    return default_cache_dir() / "kernels"


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with a logged reason) when no C compiler can build them."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed:
            return _lib
        try:
            _lib = _build_and_load()
        except Exception as e:  # no compiler, read-only cache, unsupported flags...
            _failed = True
            log.warning("native CPU kernels unavailable (%s); using float weights", e)
        return _lib


def _build_and_load() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    digest = hashlib.sha256((SOURCE + " ".join(_FLAGS) + compiler).encode()).hexdigest()[:16]
    directory = _kernel_dir()
    target = directory / f"cpu_kernels-{digest}.so"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src = Path(tmp) / "kernels.c"
            src.write_text(SOURCE)
            out = Path(tmp) / "kernels.so"
            result = subprocess.run(
                [compiler, *_FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=120
            )
            if result.returncode != 0:
                raise RuntimeError(f"compiling failed: {result.stderr.strip()[:300]}")
            os.replace(out, target)  # atomic: concurrent builders all end with a whole file
    lib = ctypes.CDLL(str(target))
    lib.int8_linear.restype = None
    lib.int8_linear.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
    ]
    return lib


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
