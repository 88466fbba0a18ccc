"""Triton matrix products for quantized weights at prefill (more rows than a decode batch): each
program computes one ``BLOCK_M x BLOCK_N`` output tile and dequantizes the packed weight tile by
tile in its K loop, so no 16-bit copy of the weight is ever written.

Weights come as ``triton_quant`` holds them: group-32 int4 in the GPU layout (each span of 64
inputs is 32 bytes, low nibbles inputs 0..31, high nibbles 32..63, ``w = scale * q + min`` per
group), int8 with a scale per row, and fp8 (E4M3) with a scale per row or per block of inputs.
Row scales multiply the tile's sums once at the end; int4 and block-scaled fp8 weights are scaled
as they are dequantized. The oracle is ``triton_quant``'s references (the dequantized weight).
"""

from __future__ import annotations

import torch

from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.ops.triton_attention import triton

if triton is not None:
    import triton.language as tl

    from trtedge.runtime.ops.triton_quant import _group_scales

    @triton.jit
    def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """The program's (row tile, column tile), GROUP_M row tiles per column sweep, so the
        weight tiles a group of programs reads stay in L2 while its activation rows do."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def _store(acc, rm, rn, M, N, b_ptr, y_ptr, stride_y, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _w8_gemm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, GROUPS,
        HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, FP8: tl.constexpr, GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """x [M, K] times 8-bit weights [N, K] (E4M3 bytes passed as uint8, or int8), scales
        [N, GROUPS] of GROUP_K inputs each (ROW_SCALE: GROUPS == 1, applied to the sums)."""
        pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm[:, None] < M
        n_ok = rn[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            k_ok = ks[None, :] < K
            x = tl.load(x_ptr + rm[:, None] * stride_x + ks[None, :], mask=m_ok & k_ok, other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_w + ks[None, :], mask=n_ok & k_ok, other=0)
            if FP8:
                w = w.to(tl.float8e4nv, bitcast=True)
            if ROW_SCALE:
                w = w.to(x.dtype)  # E4M3 and int8 values are exact in bf16 / fp16
            else:
                s = _group_scales(s_ptr, rn, k0, K, N, GROUPS, GROUP_K, BLOCK_N, BLOCK_K)
                w = (w.to(tl.float32) * s).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
        if ROW_SCALE:
            acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        _store(acc, rm, rn, M, N, b_ptr, y_ptr, stride_y, HAS_BIAS)

    @triton.jit
    def _int4_gemm_kernel(
        x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_y,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """x [M, K] times GPU-layout int4 weights ([N, K / 2] bytes, scale / min [N, K / 32]); K is
        a multiple of 64. Each span of 64 inputs is two products of 32: its low nibbles' group
        against inputs 0..31 of the span, its high nibbles' against 32..63."""
        SPANS: tl.constexpr = BLOCK_K // 64
        pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, 32)
        m_ok = rm[:, None] < M
        groups = K // 32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for s in tl.static_range(SPANS):
                kb = k0 + 64 * s
                ok = kb < K
                n_ok = (rn < N) & ok
                packed = tl.load(
                    w_ptr + rn[:, None] * (K // 2) + (kb // 2 + rj)[None, :], mask=n_ok[:, None], other=0
                )
                g = rn * groups + kb // 32
                s_lo = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                s_hi = tl.load(s_ptr + g + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                m_lo = tl.load(m_ptr + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                m_hi = tl.load(m_ptr + g + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                x_row = x_ptr + rm[:, None] * stride_x + (kb + rj)[None, :]
                x_lo = tl.load(x_row, mask=m_ok & ok, other=0.0)
                x_hi = tl.load(x_row + 32, mask=m_ok & ok, other=0.0)
                w_lo = ((packed & 0xF).to(tl.float32) * s_lo + m_lo).to(x_lo.dtype)
                w_hi = ((packed >> 4).to(tl.float32) * s_hi + m_hi).to(x_lo.dtype)
                acc += tl.dot(x_lo, tl.trans(w_lo))
                acc += tl.dot(x_hi, tl.trans(w_hi))
        _store(acc, rm, rn, M, N, b_ptr, y_ptr, stride_y, HAS_BIAS)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the number of rows: a few hundred rows
# make too few 128-row tiles to fill the GPU's SMs.
_W8_PLANS = ((64, 128, 128, 4, 4), (128, 128, 128, 8, 3))
_INT4_PLANS = ((64, 128, 128, 4, 4), (128, 128, 128, 8, 3))
_GROUP_M = 8


def _plan(plans, m: int) -> tuple[int, ...]:
    return plans[0] if m <= 512 else plans[1]


def w8_gemm(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16, rows contiguous) times fp8 / int8 ``q`` [N, K] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.data.shape[0]
    groups = q.scale.shape[1] if q.scale.dim() == 2 else 1
    fp8 = q.format == "fp8"
    bm, bn, bk, warps, stages = _plan(_W8_PLANS, m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (-(-m // bm) * -(-n // bn),)
    _w8_gemm_kernel[grid](
        x, q.data.view(torch.uint8) if fp8 else q.data, q.scale, bias if bias is not None else q.scale, y,
        m, n, k, x.stride(0), q.data.stride(0), y.stride(0), groups,
        HAS_BIAS=bias is not None, ROW_SCALE=groups == 1, FP8=fp8, GROUP_K=k // groups if groups > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=_GROUP_M, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def int4_gemm(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times GPU-layout int4 ``q`` [N, K] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.data.shape[0]
    bm, bn, bk, warps, stages = _plan(_INT4_PLANS, m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (-(-m // bm) * -(-n // bn),)
    _int4_gemm_kernel[grid](
        x, q.data, q.scale, q.min, bias if bias is not None else q.scale, y, m, n, k, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=_GROUP_M,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
