"""Triton products for quantized weights at decode (up to 64 rows, in tiles of 16): 8-bit (fp8 E4M3 or int8, with
float32 scales) and group-32 int4, each a torch reference beside it (the oracle of the GPU tests).

Both follow ``triton_gemv``: each program streams one ``BLOCK_N x K / SPLIT_K`` slab of the packed
weight once, dequantizes it in registers and multiplies in bf16/fp16 with fp32 sums; with split-K
the last program of a column tile (an atomic counter, reset for the next call or graph replay) adds
the partials, the bias, and stores.

int4 weights run in the GPU layout made by ``int4_gpu_layout``: per row, each span of 64 inputs is 32
bytes where byte j holds input j in its low nibble and input 32 + j in its high one, so the low
nibbles of a span are one whole group of 32 and the high nibbles the next; ``scale`` and ``min``
stay float16 [N, K / 32] (``w = scale * q + min``, the bundle's int4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtedge.runtime.artifacts.quantize import FP8_MAX, GROUP, QuantizedTensor, unpack_int4
from trtedge.runtime.ops.triton_attention import triton

MAX_ROWS = 16  # rows of one program; up to BATCH_ROWS rows run as row tiles (no split-K)
BATCH_ROWS = 64
SPAN = 2 * GROUP  # inputs per span of the GPU int4 layout

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _finish(
        acc, rm, rn, M, N, b_ptr, y_ptr, stride_y, part_ptr, count_ptr, pid_n, pid_k,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """Store a program's fp32 sums: directly, or (split-K) as a partial that the last program of
        the column tile adds up."""
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        last = True
        if SPLIT_K > 1:
            tile = BLOCK_M * N
            tl.store(part_ptr + pid_k * tile + rm[:, None] * N + rn[None, :], acc, mask=out_mask)
            done = tl.atomic_add(count_ptr + pid_n, 1)
            last = done == SPLIT_K - 1
            if last:
                acc = tl.zeros_like(acc)
                for s in range(SPLIT_K):
                    acc += tl.load(
                        part_ptr + s * tile + rm[:, None] * N + rn[None, :],
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                tl.atomic_xchg(count_ptr + pid_n, 0)
        if last:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + rm[:, None] * stride_y + rn[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _group_scales(
        s_ptr, rn, k0, hi, N, GROUPS,
        GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """The [BLOCK_N, BLOCK_K] scales of the inputs k0 .. k0 + BLOCK_K (tiles start at multiples of
        BLOCK_K; GROUP_K a power of two): one load per group, broadcast over its inputs (a load per
        weight would stage a float32 per weight in shared memory, 4x the weight tile itself)."""
        if GROUP_K >= BLOCK_K:
            s = tl.load(s_ptr + rn * GROUPS + k0 // GROUP_K, mask=rn < N, other=0.0)
            return tl.broadcast_to(s[:, None], (BLOCK_N, BLOCK_K))
        else:
            G: tl.constexpr = BLOCK_K // GROUP_K
            rg = tl.arange(0, G)
            mask = (rn[:, None] < N) & ((k0 + rg * GROUP_K)[None, :] < hi)
            s = tl.load(s_ptr + rn[:, None] * GROUPS + (k0 // GROUP_K + rg)[None, :], mask=mask, other=0.0)
            return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, G, GROUP_K)), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _w8_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, stride_x, stride_w, stride_y, GROUPS,
        HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, FP8: tl.constexpr, GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        ONE_ROW: tl.constexpr = False,
    ):  # fmt: skip
        """8-bit weights [N, K] with scales [N, GROUPS] (GROUP_K inputs each). ROW_SCALE (one scale
        per row): the scale multiplies the sums; else each weight before the product. FP8: the bytes
        (passed as uint8) are E4M3 values; else int8. ONE_ROW (M == 1): products and sums in float32
        registers, no tensor-core tile of 15 empty rows."""
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        lo = pid_k * span
        hi = tl.minimum(lo + span, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ONE_ROW:
            row = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(lo, hi, BLOCK_K):
                ks = k0 + rk
                x1 = tl.load(x_ptr + ks, mask=ks < hi, other=0.0).to(tl.float32)
                w_mask = (rn[:, None] < N) & (ks[None, :] < hi)
                w = tl.load(
                    w_ptr + rn[:, None] * stride_w + ks[None, :],
                    mask=w_mask,
                    other=0,
                    eviction_policy="evict_first",
                )
                if FP8:
                    w = w.to(tl.float8e4nv, bitcast=True)
                w = w.to(tl.float32)
                if not ROW_SCALE:
                    w = w * _group_scales(s_ptr, rn, k0, hi, N, GROUPS, GROUP_K, BLOCK_N, BLOCK_K)
                row += tl.sum(w * x1[None, :], axis=1)
            acc += row[None, :]  # every row of the tile holds it; only row 0 (M == 1) is stored
        else:
            for k0 in range(lo, hi, BLOCK_K):
                ks = k0 + rk
                x = tl.load(
                    x_ptr + rm[:, None] * stride_x + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < hi),
                    other=0.0,
                )
                w_mask = (rn[:, None] < N) & (ks[None, :] < hi)
                w = tl.load(
                    w_ptr + rn[:, None] * stride_w + ks[None, :],
                    mask=w_mask,
                    other=0,
                    eviction_policy="evict_first",
                )
                if FP8:
                    w = w.to(tl.float8e4nv, bitcast=True)
                if ROW_SCALE:
                    w = w.to(x.dtype)  # E4M3 and int8 values are exact in bf16 / fp16
                else:
                    s = _group_scales(s_ptr, rn, k0, hi, N, GROUPS, GROUP_K, BLOCK_N, BLOCK_K)
                    w = (w.to(tl.float32) * s).to(x.dtype)
                acc += tl.dot(x, tl.trans(w))
        if ROW_SCALE:
            acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        _finish(
            acc, rm, rn, M, N, b_ptr, y_ptr, stride_y, part_ptr, count_ptr, pid_n, pid_k,
            HAS_BIAS, BLOCK_M, SPLIT_K,
        )  # fmt: skip

    @triton.jit
    def _int4_kernel(
        x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, stride_x, stride_y,
        HAS_BIAS: tl.constexpr, SCALE_AFTER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        ONE_ROW: tl.constexpr = False,
    ):  # fmt: skip
        """int4 weights in the GPU layout ([N, K / 2] bytes, scale / min [N, K / 32] float16).
        SCALE_AFTER: scale the products of the codes (else each dequantized weight). ONE_ROW (M == 1):
        each group's code products summed in float32 registers, then its scale and min applied."""
        HALF: tl.constexpr = BLOCK_K // 2
        SPANS: tl.constexpr = BLOCK_K // 64
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.arange(0, HALF)  # byte of the tile
        rs = tl.arange(0, SPANS)  # span of the tile
        k_low = (rb // 32) * 64 + rb % 32  # the input of each byte's low nibble, within the tile
        groups = K // 32
        span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        lo = pid_k * span
        hi = tl.minimum(lo + span, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ONE_ROW:
            rj = tl.arange(0, 32)
            row = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(lo, hi, BLOCK_K):
                for s in tl.static_range(SPANS):
                    kb = k0 + 64 * s
                    ok = kb < hi
                    n_ok = (rn < N) & ok
                    packed = tl.load(
                        w_ptr + rn[:, None] * (K // 2) + (kb // 2 + rj)[None, :],
                        mask=n_ok[:, None],
                        other=0,
                        eviction_policy="evict_first",
                    )
                    g = rn * groups + kb // 32
                    s_lo = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
                    s_hi = tl.load(s_ptr + g + 1, mask=n_ok, other=0.0).to(tl.float32)
                    m_lo = tl.load(m_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
                    m_hi = tl.load(m_ptr + g + 1, mask=n_ok, other=0.0).to(tl.float32)
                    x_ok = (rj < 32) & ok
                    x_lo = tl.load(x_ptr + kb + rj, mask=x_ok, other=0.0).to(tl.float32)
                    x_hi = tl.load(x_ptr + kb + 32 + rj, mask=x_ok, other=0.0).to(tl.float32)
                    d_lo = tl.sum((packed & 0xF).to(tl.float32) * x_lo[None, :], axis=1)
                    d_hi = tl.sum((packed >> 4).to(tl.float32) * x_hi[None, :], axis=1)
                    row += d_lo * s_lo + tl.sum(x_lo, axis=0) * m_lo
                    row += d_hi * s_hi + tl.sum(x_hi, axis=0) * m_hi
            acc += row[None, :]  # every row of the tile holds it; only row 0 (M == 1) is stored
        elif SCALE_AFTER:
            # the codes times the activations first, then each group's scale and min on the sums:
            # one span (two groups) at a time, ~1 operation a weight instead of ~3
            rj = tl.arange(0, 32)
            for k0 in range(lo, hi, BLOCK_K):
                for s in tl.static_range(SPANS):
                    kb = k0 + 64 * s
                    ok = kb < hi
                    n_ok = (rn < N) & ok
                    packed = tl.load(
                        w_ptr + rn[:, None] * (K // 2) + (kb // 2 + rj)[None, :],
                        mask=n_ok[:, None],
                        other=0,
                        eviction_policy="evict_first",
                    )
                    g = rn * groups + kb // 32
                    s_lo = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
                    s_hi = tl.load(s_ptr + g + 1, mask=n_ok, other=0.0).to(tl.float32)
                    m_lo = tl.load(m_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
                    m_hi = tl.load(m_ptr + g + 1, mask=n_ok, other=0.0).to(tl.float32)
                    x_mask = (rm[:, None] < M) & ok
                    x_lo = tl.load(
                        x_ptr + rm[:, None] * stride_x + (kb + rj)[None, :], mask=x_mask, other=0.0
                    )
                    x_hi = tl.load(
                        x_ptr + rm[:, None] * stride_x + (kb + 32 + rj)[None, :], mask=x_mask, other=0.0
                    )
                    d_lo = tl.dot(x_lo, tl.trans((packed & 0xF).to(x_lo.dtype)))
                    d_hi = tl.dot(x_hi, tl.trans((packed >> 4).to(x_lo.dtype)))
                    sum_lo = tl.sum(x_lo.to(tl.float32), axis=1)
                    sum_hi = tl.sum(x_hi.to(tl.float32), axis=1)
                    acc += d_lo * s_lo[None, :] + sum_lo[:, None] * m_lo[None, :]
                    acc += d_hi * s_hi[None, :] + sum_hi[:, None] * m_hi[None, :]
        else:
            for k0 in range(lo, hi, BLOCK_K):
                kl = k0 + k_low
                n_ok = rn[:, None] < N
                b_mask = n_ok & (kl[None, :] < hi)
                packed = tl.load(
                    w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + rb)[None, :],
                    mask=b_mask,
                    other=0,
                    eviction_policy="evict_first",
                )
                g = k0 // 32 + 2 * rs  # the low nibbles' group of each span
                g_mask = n_ok & ((k0 + 64 * rs)[None, :] < hi)
                g_ptr = rn[:, None] * groups + g[None, :]
                s_lo = tl.load(s_ptr + g_ptr, mask=g_mask, other=0.0).to(tl.float32)
                s_hi = tl.load(s_ptr + g_ptr + 1, mask=g_mask, other=0.0).to(tl.float32)
                m_lo = tl.load(m_ptr + g_ptr, mask=g_mask, other=0.0).to(tl.float32)
                m_hi = tl.load(m_ptr + g_ptr + 1, mask=g_mask, other=0.0).to(tl.float32)
                s_lo = tl.reshape(tl.broadcast_to(s_lo[:, :, None], (BLOCK_N, SPANS, 32)), (BLOCK_N, HALF))
                s_hi = tl.reshape(tl.broadcast_to(s_hi[:, :, None], (BLOCK_N, SPANS, 32)), (BLOCK_N, HALF))
                m_lo = tl.reshape(tl.broadcast_to(m_lo[:, :, None], (BLOCK_N, SPANS, 32)), (BLOCK_N, HALF))
                m_hi = tl.reshape(tl.broadcast_to(m_hi[:, :, None], (BLOCK_N, SPANS, 32)), (BLOCK_N, HALF))
                x_mask = (rm[:, None] < M) & (kl[None, :] < hi)
                x_lo = tl.load(x_ptr + rm[:, None] * stride_x + kl[None, :], mask=x_mask, other=0.0)
                x_hi = tl.load(x_ptr + rm[:, None] * stride_x + kl[None, :] + 32, mask=x_mask, other=0.0)
                w_lo = ((packed & 0xF).to(tl.float32) * s_lo + m_lo).to(x_lo.dtype)
                w_hi = ((packed >> 4).to(tl.float32) * s_hi + m_hi).to(x_lo.dtype)
                acc += tl.dot(x_lo, tl.trans(w_lo))
                acc += tl.dot(x_hi, tl.trans(w_hi))
        _finish(
            acc, rm, rn, M, N, b_ptr, y_ptr, stride_y, part_ptr, count_ptr, pid_n, pid_k,
            HAS_BIAS, BLOCK_M, SPLIT_K,
        )  # fmt: skip

    @triton.jit
    def _int4_dequant_kernel(w_ptr, s_ptr, m_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr):
        """The dense weight of a GPU-layout int4 tensor, one span of 64 inputs of BLOCK_N rows each."""
        pid_n = tl.program_id(0)
        span = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, 32)
        mask = rn[:, None] < N
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + span * 32 + rj[None, :], mask=mask, other=0)
        g = rn * (K // 32) + 2 * span
        s_lo = tl.load(s_ptr + g, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        s_hi = tl.load(s_ptr + g + 1, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        m_lo = tl.load(m_ptr + g, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        m_hi = tl.load(m_ptr + g + 1, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + rn[:, None] * K + span * 64 + rj[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(out, ((packed & 0xF).to(tl.float32) * s_lo + m_lo).to(ty), mask=mask)
        tl.store(out + 32, ((packed >> 4).to(tl.float32) * s_hi + m_hi).to(ty), mask=mask)

    @triton.jit
    def _store_e4m3_row(y, q_ptr, s_ptr, r, mask):
        """A float32 row as E4M3 bytes at q_ptr + r with its scale at s_ptr (largest magnitude -> 448)."""
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
        tl.store(s_ptr, scale)
        q = tl.clamp(y / scale, -448.0, 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + r, q.to(tl.uint8, bitcast=True), mask=mask)

    @triton.jit
    def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
        """One activation row to E4M3 with its own scale, the row held in registers (BLOCK >= K):
        read once, the E4M3 bytes written once."""
        row = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + r, mask=r < K, other=0.0).to(tl.float32)
        _store_e4m3_row(x, q_ptr + row * K, s_ptr + row, r, r < K)

    @triton.jit
    def _fp8_norm_rows_kernel(
        x_ptr, delta_ptr, w_ptr, q_ptr, s_ptr, K, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        """x += delta (HAS_DELTA, stored back), then RMSNorm(x) * w rounded as ``rms_norm`` rounds
        it, written as E4M3 with a scale per row: the norm and the activation quantization of an
        fp8 product in one pass (no 16-bit normed copy)."""
        row = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        mask = r < K
        x = tl.load(x_ptr + row * K + r, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * K + r, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * K + r, x, mask=mask)
        dt = x_ptr.dtype.element_ty
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        w = tl.load(w_ptr + r, mask=mask, other=0.0).to(tl.float32)
        y = ((xf * inv).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        _store_e4m3_row(y, q_ptr + row * K, s_ptr + row, r, mask)

    @triton.jit
    def _fp8_silu_rows_kernel(gate_up_ptr, q_ptr, s_ptr, inter, BLOCK: tl.constexpr):
        """SiLU(gate) * up of one row of gate_up [M, 2 * inter] (rounded as the model's SiLU-mul),
        written as E4M3 with a scale per row: the activation of down's fp8 product in one pass."""
        row = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        mask = r < inter
        g = tl.load(gate_up_ptr + row * 2 * inter + r, mask=mask, other=0.0)
        u = tl.load(gate_up_ptr + row * 2 * inter + inter + r, mask=mask, other=0.0).to(tl.float32)
        dt = gate_up_ptr.dtype.element_ty
        g = g.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        y = (act * u).to(dt).to(tl.float32)
        _store_e4m3_row(y, q_ptr + row * inter, s_ptr + row, r, mask)


# ---- the GPU int4 layout and the torch references ----------------------------------------------------
def int4_gpu_layout(q: QuantizedTensor) -> QuantizedTensor:
    """A bundle's int4 tensor (the CPU kernel's packing) repacked in the GPU layout, on q's device."""
    rows, cols = q.shape
    if cols % SPAN:
        raise ValueError(
            f"the GPU int4 layout needs the input dimension to be a multiple of {SPAN}, got {cols}"
        )
    values = unpack_int4(q.data).view(rows, cols // SPAN, 2, GROUP)
    packed = values[:, :, 0] | (values[:, :, 1] << 4)
    return QuantizedTensor("int4", packed.reshape(rows, cols // 2).contiguous(), q.scale, q.min)


def int4_gpu_dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight of a GPU-layout int4 tensor (the reference of the kernels)."""
    rows, width = q.data.shape
    packed = q.data.view(rows, -1, 1, GROUP)
    values = torch.cat([packed & 0x0F, packed >> 4], dim=2).view(rows, -1, GROUP).float()
    w = values * q.scale.float()[..., None] + q.min.float()[..., None]
    return w.view(rows, width * 2).to(dtype)


def w8_reference(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp8 / int8 product in float32, the oracle of ``w8_product``."""
    return F.linear(x.float(), q.dequantize(), None if bias is None else bias.float())


def int4_reference(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GPU-layout int4 product in float32, the oracle of ``int4_product``."""
    return F.linear(x.float(), int4_gpu_dequantize(q), None if bias is None else bias.float())


# ---- launches -----------------------------------------------------------------------------------------
_partials: dict[torch.device, list[torch.Tensor]] = {}


class Workspace:
    """A weight's split-K partials and per-tile counters (the counters reset themselves). The
    partials are one buffer shared by all weights of a device (one stream runs them in turn), sized
    when the layers are made, before any capture: a buffer a captured graph uses is never freed."""

    def __init__(self, n: int, k: int, table, device: torch.device):
        splits = [plan[2] for plan in candidates(table, n, k) if plan[2] > 1]
        need = max(splits, default=0) * MAX_ROWS * n
        pool = _partials.setdefault(device, [])
        if not pool or pool[-1].numel() < need:
            pool.append(torch.empty(max(need, 1), device=device))
        self.partials = pool[-1]
        self.counts = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)


def w8_product(x: torch.Tensor, q: QuantizedTensor, bias, plan, ws: Workspace) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) times fp8 / int8 ``q`` [N, K] -> [M, N] in x's dtype. The row tiles of
    a column tile are neighbours in the grid, so they read its weight slab from L2 after the first."""
    m, k = x.shape
    n = q.data.shape[0]
    block_n, block_k, split, warps, variant = plan
    groups = q.scale.shape[1] if q.scale.dim() == 2 else 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fp8 = q.format == "fp8"
    assert split == 1 or m <= MAX_ROWS, "split-K partials hold one row tile"
    assert variant < ONE_ROW or m == 1, "a one-row plan takes one row"
    if variant >= GEMV:
        if groups == 1:
            from trtedge.runtime.ops.triton_quant_gemv import w8_gemv

            return w8_gemv(x, q, bias, plan, ws, mode=variant - GEMV)
        variant = ONE_ROW  # block scales: the one-row kernel of the same tiling
    _w8_kernel[(-(-m // MAX_ROWS), -(-n // block_n), split)](
        x, q.data.view(torch.uint8) if fp8 else q.data, q.scale, bias if bias is not None else q.scale, y, ws.partials, ws.counts,
        m, n, k, x.stride(0), q.data.stride(0), y.stride(0), groups,
        HAS_BIAS=bias is not None, ROW_SCALE=groups == 1, FP8=fp8, GROUP_K=k // groups if groups > 1 else 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, ONE_ROW=variant == ONE_ROW,
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    return y


def int4_product(x: torch.Tensor, q: QuantizedTensor, bias, plan, ws: Workspace) -> torch.Tensor:
    """x [M, K] times GPU-layout int4 ``q`` [N, K] -> [M, N] in x's dtype (row tiles as ``w8_product``)."""
    m, k = x.shape
    n = q.data.shape[0]
    block_n, block_k, split, warps, after = plan
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert split == 1 or m <= MAX_ROWS, "split-K partials hold one row tile"
    assert after < ONE_ROW or m == 1, "a one-row plan takes one row"
    if after == GEMV:
        from trtedge.runtime.ops.triton_quant_gemv import int4_gemv

        return int4_gemv(x, q, bias, plan, ws)
    _int4_kernel[(-(-m // MAX_ROWS), -(-n // block_n), split)](
        x, q.data, q.scale, q.min, bias if bias is not None else q.scale, y, ws.partials, ws.counts,
        m, n, k, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SCALE_AFTER=after == 1, ONE_ROW=after == ONE_ROW,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return y


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (E4M3 [M, K], float32 scales [M, 1]) with a scale per row
    (``x ~ q * s``, the row's largest magnitude -> 448)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    # a row a program, at most 64 values a thread: on the H200 at 8,192 rows 3.7-4.3 TB/s against
    # the earlier two-pass kernel's 2.3-3.0 (benchmarks/gpu_quant_prefill.py)
    block = triton.next_power_of_2(k)
    _fp8_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=block, num_warps=_rows_warps(block))
    return q.view(torch.float8_e4m3fn), scale


def _rows_warps(block: int) -> int:
    """Warps of a one-row-a-program kernel over ``block`` values: at most 64 values a thread."""
    return 4 if block <= 4096 else 8 if block <= 16384 else 16


def fp8_norm_rows(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``x += delta`` in place (when given), then ``fp8_rows(rms_norm(x, weight, eps))`` in one
    kernel: x, delta [M, K] contiguous bf16 / fp16 -> (E4M3 [M, K], float32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _fp8_norm_rows_kernel[(m,)](
        x, x if delta is None else delta, weight, q, scale, k, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=_rows_warps(block),
    )  # fmt: skip
    return q.view(torch.float8_e4m3fn), scale


def fp8_silu_mul_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_rows(silu(gate) * up)`` of gate_up [M, 2 * I] (contiguous) in one kernel."""
    m, width = gate_up.shape
    inter = width // 2
    q = torch.empty(m, inter, dtype=torch.uint8, device=gate_up.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    block = triton.next_power_of_2(inter)
    _fp8_silu_rows_kernel[(m,)](gate_up, q, scale, inter, BLOCK=block, num_warps=_rows_warps(block))
    return q.view(torch.float8_e4m3fn), scale


def fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def int4_dequantize(q: QuantizedTensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight of a GPU-layout int4 tensor, through the Triton kernel (prefill)."""
    n, k = q.data.shape[0], q.data.shape[1] * 2
    out = torch.empty(n, k, dtype=dtype, device=q.data.device) if out is None else out
    _int4_dequant_kernel[(-(-n // 64), k // SPAN)](q.data, q.scale, q.min, out, n, k, BLOCK_N=64)
    return out


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, variant) candidates; the fastest per shape and row
# bucket is kept (``quant_linear``). An 8-bit weight moves BLOCK_K bytes a row per step, an int4 one
# BLOCK_K / 2; int4 variant 1 scales the products of the codes (``SCALE_AFTER``); variant ONE_ROW
# (batch-1 decode only) sums in registers without the tensor cores; GEMV (batch 1) runs the one-row
# products of ``triton_quant_gemv`` (whole tiles on fp16 tensor cores; the fastest at batch 1 on
# every Qwen3-8B shape on the H200, ``benchmarks/gpu_quant_gemv.py``), and 8-bit GEMV_FMA that
# module's float32 register-tile product (the fastest fp8 one on the 4096 x 4096 o_proj).
ONE_ROW = 2
GEMV = 3
GEMV_FMA = 4
W8_CANDIDATES = (
    (32, 128, 1, 4, 0), (64, 128, 1, 4, 0), (32, 256, 1, 4, 0), (64, 256, 1, 4, 0), (128, 256, 1, 8, 0),
    (32, 256, 4, 4, 0), (64, 256, 4, 4, 0), (32, 512, 2, 4, 0), (32, 128, 8, 4, 0),
    (32, 256, 1, 4, 2), (64, 256, 1, 8, 2), (32, 512, 1, 8, 2), (32, 256, 4, 4, 2),
    (64, 256, 1, 4, 3), (32, 256, 1, 4, 3), (64, 256, 4, 4, 3), (32, 256, 2, 4, 3),
    (32, 256, 4, 4, 4), (32, 256, 2, 4, 4),
)  # fmt: skip
INT4_CANDIDATES = (
    (32, 128, 1, 4, 0), (64, 256, 1, 4, 0), (32, 512, 1, 4, 0), (64, 512, 1, 8, 0), (128, 256, 1, 8, 0),
    (32, 256, 4, 4, 0), (64, 256, 4, 8, 0), (32, 512, 4, 4, 0), (32, 256, 8, 4, 0),
    (32, 256, 1, 4, 1), (64, 256, 1, 4, 1), (64, 512, 1, 8, 1), (32, 256, 4, 4, 1), (64, 256, 4, 4, 1),
    (32, 256, 1, 4, 2), (64, 512, 1, 4, 2), (32, 512, 4, 4, 2), (64, 256, 4, 4, 2),
    (64, 256, 1, 4, 3), (64, 256, 4, 4, 3), (32, 256, 4, 4, 3),
)  # fmt: skip
DEFAULT_PLAN = (32, 128, 1, 4, 0)  # a capture that reaches an untimed shape uses it


def fits(plan: tuple[int, ...], rows: int) -> bool:
    """Whether ``plan`` takes ``rows`` rows: split-K one row tile, a one-row plan one row."""
    return (plan[2] == 1 or rows <= MAX_ROWS) and (plan[4] < ONE_ROW or rows == 1)


def candidates(table, n: int, k: int) -> list[tuple[int, ...]]:
    """The plans of ``table`` that fit a weight [n, k]: each split at least one BLOCK_K deep, and
    split-K only where the columns alone make few programs."""
    return [p for p in table if k // p[2] >= p[1] and (p[2] == 1 or -(-n // p[0]) <= 512)]
