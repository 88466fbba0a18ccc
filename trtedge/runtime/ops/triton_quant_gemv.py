"""Batch-1 decode products for quantized weights (one activation row): fp8 (E4M3) / int8 with one
scale per row, and group-32 int4 in the GPU layout of ``triton_quant``. The references of
``triton_quant`` are the oracles.

Each program streams a contiguous ``BLOCK_N x BLOCK_K`` tile of the packed weight per step (whole
rows of 16-byte loads: the K loop runs over tile indices, so every offset is a multiple of
BLOCK_K, and EVEN shapes drop the masks), converts it to fp16 and multiplies on the tensor cores
against the activation row (rows 1..15 of the 16-row tile repeat it and are never stored); the
per-row scale multiplies the fp32 sums once, in the epilogue. The activation goes to fp16 times
2^-4 (bf16 values keep their bits up to 2^20), undone in the epilogue.

int4 (``CONVERT`` = 1) unpacks its nibbles with inline PTX: four bytes -> eight fp16 codes in a dozen
integer / half2 instructions (magic-number conversion, no int -> float conversion instructions),
then each group's scale and min make the fp16 weight (``w = scale * q + min``, one rounding).
"""

from __future__ import annotations

import torch

from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.ops.triton_attention import triton

X_SCALE = 0.0625  # the activation's factor on its way to fp16; the sums are divided by it

if triton is not None:
    import triton.language as tl

    from trtedge.runtime.ops.triton_quant import _finish

    @triton.jit
    def _x_row(x_ptr, ks, K, EVEN: tl.constexpr):
        """The activation at inputs ``ks`` as fp16 times X_SCALE, broadcast to a 16-row tile."""
        if EVEN:
            x = tl.load(x_ptr + ks)
        else:
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
        xh = (x.to(tl.float32) * 0.0625).to(tl.float16)
        return tl.broadcast_to(xh[None, :], (16, ks.shape[0]))

    @triton.jit
    def _w8_gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N, K, stride_w,
        HAS_BIAS: tl.constexpr, FP8: tl.constexpr, MODE: tl.constexpr, EVEN: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """8-bit weights [N, K] (E4M3 bytes as uint8, or int8), one float32 scale per row. MODE 0:
        fp16 tensor-core products; MODE 1: float32 products summed in a [BLOCK_N, BLOCK_K] register
        tile, reduced once at the end."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, 16)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        tiles = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(tiles, SPLIT_K)
        t0 = pid_k * per_split
        t1 = tl.minimum(t0 + per_split, tiles)
        w_rows = w_ptr + rn[:, None] * stride_w
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t in range(t0, t1):
            ks = t * BLOCK_K + rk
            if EVEN:
                w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(
                    w_rows + ks[None, :],
                    mask=(rn[:, None] < N) & (ks[None, :] < K),
                    other=0,
                    eviction_policy="evict_first",
                )
            if FP8:
                w = w.to(tl.float8e4nv, bitcast=True)
            if MODE == 0:
                acc += tl.dot(_x_row(x_ptr, ks, K, EVEN), tl.trans(w.to(tl.float16)))
            else:
                if EVEN:
                    x = tl.load(x_ptr + ks).to(tl.float32)
                else:
                    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                acc2 += w.to(tl.float32) * x[None, :]
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        if MODE == 0:
            acc = acc * (scale * 16.0)[None, :]  # 16 = 1 / X_SCALE
        else:
            acc = tl.broadcast_to((tl.sum(acc2, axis=1) * scale)[None, :], (16, BLOCK_N))
        _finish(
            acc, rm, rn, 1, N, b_ptr, y_ptr, 0, part_ptr, count_ptr, pid_n, pid_k,
            HAS_BIAS, 16, SPLIT_K,
        )  # fmt: skip

    @triton.jit
    def _int4_codes(packed, CONVERT: tl.constexpr):
        """The low and high nibbles of uint8 ``packed`` as fp16 (exact: 0 .. 15)."""
        if CONVERT:
            # per 4 bytes: spread bytes 0,1 (2,3) into the low byte of each half, OR in the exponent
            # of 1024 (0x6400: the nibble lands in the units of the mantissa), subtract 1024
            lo, hi = tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 t0, t1, z, c, f;
                mov.b32 z, 0;
                mov.b32 c, 0x64006400;
                mov.b32 f, 0x000F000F;
                prmt.b32 t0, $4, z, 0x4140;
                prmt.b32 t1, $4, z, 0x4342;
                lop3.b32 $0, t0, f, c, 0xEA;
                lop3.b32 $1, t1, f, c, 0xEA;
                shr.u32 t0, t0, 4;
                shr.u32 t1, t1, 4;
                lop3.b32 $2, t0, f, c, 0xEA;
                lop3.b32 $3, t1, f, c, 0xEA;
                sub.f16x2 $0, $0, c;
                sub.f16x2 $1, $1, c;
                sub.f16x2 $2, $2, c;
                sub.f16x2 $3, $3, c;
                }
                """,
                constraints="=r,=r,=r,=r,r",
                args=[packed],
                dtype=(tl.float16, tl.float16),
                is_pure=True,
                pack=4,
            )
        else:
            lo = (packed & 0xF).to(tl.float16)
            hi = (packed >> 4).to(tl.float16)
        return lo, hi

    @triton.jit
    def _int4_gemv_kernel(
        x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N, K,
        HAS_BIAS: tl.constexpr, CONVERT: tl.constexpr, EVEN: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """GPU-layout int4 (bytes [N, K / 2], scale / min float16 [N, K / 32]): per step one
        [BLOCK_N, BLOCK_K / 2] byte tile, its fp16 weights (scale * code + min) on the tensor cores.
        CONVERT: the nibbles through inline PTX (else Triton casts, which the interpreter runs)."""
        HALF: tl.constexpr = BLOCK_K // 2
        SPANS: tl.constexpr = BLOCK_K // 64
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, 16)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.arange(0, HALF)
        rg = tl.arange(0, 2 * SPANS)
        groups = K // 32
        tiles = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(tiles, SPLIT_K)
        t0 = pid_k * per_split
        t1 = tl.minimum(t0 + per_split, tiles)
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None] * (K // 2)
        g_rows = rn[:, None] * groups
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for t in range(t0, t1):
            bs = t * HALF + rb
            if EVEN:
                packed = tl.load(w_rows + bs[None, :], eviction_policy="evict_first")
            else:
                packed = tl.load(
                    w_rows + bs[None, :],
                    mask=n_ok[:, None] & (bs[None, :] < K // 2),
                    other=0,
                    eviction_policy="evict_first",
                )
            gs = t * (2 * SPANS) + rg
            g_mask = n_ok[:, None] & (gs[None, :] < groups)
            sc = tl.load(s_ptr + g_rows + gs[None, :], mask=g_mask, other=0.0)
            mn = tl.load(m_ptr + g_rows + gs[None, :], mask=g_mask, other=0.0)
            s_lo, s_hi = tl.split(tl.reshape(sc, (BLOCK_N, SPANS, 2)))
            m_lo, m_hi = tl.split(tl.reshape(mn, (BLOCK_N, SPANS, 2)))
            lo, hi = _int4_codes(packed, CONVERT)
            w_lo = tl.reshape(
                tl.reshape(lo, (BLOCK_N, SPANS, 32)) * s_lo[:, :, None] + m_lo[:, :, None],
                (BLOCK_N, HALF),
            )
            w_hi = tl.reshape(
                tl.reshape(hi, (BLOCK_N, SPANS, 32)) * s_hi[:, :, None] + m_hi[:, :, None],
                (BLOCK_N, HALF),
            )
            k_lo = t * BLOCK_K + (rb // 32) * 64 + rb % 32  # the input of each byte's low nibble
            acc += tl.dot(_x_row(x_ptr, k_lo, K, EVEN), tl.trans(w_lo.to(tl.float16)))
            acc += tl.dot(_x_row(x_ptr, k_lo + 32, K, EVEN), tl.trans(w_hi.to(tl.float16)))
        acc = acc * 16.0  # 1 / X_SCALE
        _finish(
            acc, rm, rn, 1, N, b_ptr, y_ptr, 0, part_ptr, count_ptr, pid_n, pid_k,
            HAS_BIAS, 16, SPLIT_K,
        )  # fmt: skip


def _even(n: int, k: int, block_n: int, block_k: int) -> bool:
    """Whether every tile is whole (splits run over whole tiles, so they need no mask)."""
    return n % block_n == 0 and k % block_k == 0


def w8_gemv(x: torch.Tensor, q: QuantizedTensor, bias, plan, ws, mode: int = 0) -> torch.Tensor:
    """x [1, K] (bf16 / fp16) times fp8 / int8 ``q`` [N, K] with one scale per row -> [1, N].
    ``plan`` = (BLOCK_N, BLOCK_K, SPLIT_K, num_warps); ``ws`` a ``triton_quant.Workspace``."""
    k = x.shape[1]
    n = q.data.shape[0]
    block_n, block_k, split, warps = plan[:4]
    assert x.shape[0] == 1 and q.scale.numel() == n, "one row, one scale per weight row"
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    fp8 = q.format == "fp8"
    _w8_gemv_kernel[(-(-n // block_n), split)](
        x, q.data.view(torch.uint8) if fp8 else q.data, q.scale, bias if bias is not None else q.scale,
        y, ws.partials, ws.counts, n, k, q.data.stride(0),
        HAS_BIAS=bias is not None, FP8=fp8, MODE=mode, EVEN=_even(n, k, block_n, block_k),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return y


def int4_gemv(x: torch.Tensor, q: QuantizedTensor, bias, plan, ws, convert: bool = True):
    """x [1, K] times GPU-layout int4 ``q`` [N, K] -> [1, N] (``plan`` as ``w8_gemv``)."""
    k = x.shape[1]
    n = q.data.shape[0]
    block_n, block_k, split, warps = plan[:4]
    assert x.shape[0] == 1 and block_k % 64 == 0
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(-(-n // block_n), split)](
        x, q.data, q.scale, q.min, bias if bias is not None else q.scale, y, ws.partials, ws.counts, n, k,
        HAS_BIAS=bias is not None, CONVERT=convert, EVEN=_even(n, k, block_n, block_k),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return y
