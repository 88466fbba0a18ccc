"""Triton product for skinny activations (decode: at most 16 rows) with bf16/fp16 weights.

At batch 1 cuBLAS reads some decode-sized weights far below the H200's bandwidth (a Qwen3-0.6B
o_proj at 0.36 TB/s). Here each program streams one ``BLOCK_N x K/SPLIT_K`` slab of the weight
once; with split-K the last program of a column tile (found through an atomic counter, which it
resets for the next call or graph replay) sums the fp32 partials, adds the bias and stores.
Which tiling wins depends on the shape, so each weight times a few plans (and cuBLAS) once per
row bucket and keeps the fastest. ``F.linear`` is the oracle."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trtedge.runtime.ops import pdl
from trtedge.runtime.ops.triton_attention import available, triton

MAX_ROWS = 16

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _row_inv(x_ptr, rm, rk, M, K, stride_x, eps, NORM_IN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
        """Each row's 1/rms over all K columns (NORM_IN), else ones."""
        inv = tl.full((BLOCK_M,), 1.0, tl.float32)
        if NORM_IN:  # wide tiles: few round trips before the main loop can start
            cols = tl.arange(0, 512)
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, 512):
                ks = k0 + cols
                xf = tl.load(
                    x_ptr + rm[:, None] * stride_x + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0,
                ).to(tl.float32)
                squares += tl.sum(xf * xf, 1)
            inv = tl.rsqrt(squares / K + eps)
        return inv

    @triton.jit
    def _x_tile_late(x_ptr, norm_ptr, rm, ks, M, hi, stride_x, dt: tl.constexpr):
        """LATE_NORM's input tile: x * norm (the row's 1/rms applied to the sums), and the tile's
        squares of x for that 1/rms."""
        xf = tl.load(
            x_ptr + rm[:, None] * stride_x + ks[None, :],
            mask=(rm[:, None] < M) & (ks[None, :] < hi),
            other=0.0,
        ).to(tl.float32)
        scale = tl.load(norm_ptr + ks, mask=ks < hi, other=0.0).to(tl.float32)
        return (xf * scale[None, :]).to(dt), tl.sum(xf * xf, 1)

    @triton.jit
    def _x_tile(x_ptr, norm_ptr, inv, rm, ks, M, K, hi, stride_x, dt: tl.constexpr,
                NORM_IN: tl.constexpr, SILU_IN: tl.constexpr):  # fmt: skip
        """The product's input at columns ``ks`` of every row, with its folded-in prologue."""
        x_mask = (rm[:, None] < M) & (ks[None, :] < hi)
        x_at = x_ptr + rm[:, None] * stride_x + ks[None, :]
        if SILU_IN:
            g = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
            u = tl.load(x_at + K, mask=x_mask, other=0.0).to(tl.float32)
            x = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt)
        elif NORM_IN:
            xf = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
            scale = tl.load(norm_ptr + ks, mask=ks < hi, other=0.0).to(tl.float32)
            x = ((xf * inv[:, None]).to(dt).to(tl.float32) * scale[None, :]).to(dt)
        else:
            x = tl.load(x_at, mask=x_mask, other=0.0)
        return x

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        part_ptr,
        count_ptr,
        norm_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_norm_ptr,
        k_norm_ptr,
        slot_ptr,
        k_cache_ptr,
        v_cache_ptr,
        M,
        N,
        K,
        stride_x,
        stride_w,
        stride_y,
        eps,
        HAS_BIAS: tl.constexpr,
        NORM_IN: tl.constexpr,
        SILU_IN: tl.constexpr,
        RESIDUAL_OUT: tl.constexpr,
        ROPE_OUT: tl.constexpr,
        QK_NORM: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PDL: tl.constexpr,
        EARLY_TILE: tl.constexpr,
        LATE_NORM: tl.constexpr,
        SILU_OUT: tl.constexpr,
    ):
        # SILU_OUT: the weight is [gate; up] (N rows each) and y = silu(gate) * up, N columns; the
        # program sums a gate tile and the up tile N rows below it (not with EARLY_TILE). NORM_IN: x is the residual stream; the product reads RMSNorm(x) * norm (the row's 1/rms from
        # a first pass over the whole row). SILU_IN: x is [gate | up] (K columns each); the product
        # reads silu(gate) * up. RESIDUAL_OUT: y is the residual stream, and gets the product added.
        # ROPE_OUT: the product is a fused qkv, one head per column tile (BLOCK_N = head_dim): q heads
        # get q-norm (QK_NORM) and RoPE into y, k heads k-norm and RoPE into the cache, v heads go to
        # the cache. Roundings are the unfused kernels' (triton_fused), which follow HF. LATE_NORM
        # (instead of NORM_IN): no first pass; the product reads x * norm rounded once and its sums
        # are scaled by the row's 1/rms (squares summed from the same tiles, across the splits).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        dt = y_ptr.dtype.element_ty
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        lo = pid_k * span
        hi = tl.minimum(lo + span, K)
        w_rows = w_ptr + rn[:, None] * stride_w
        if EARLY_TILE:  # PDL or NORM_IN
            # The weights are no kernel's output: the first tile loads before waiting for the
            # previous kernel (ops.pdl) and before the norm's first pass, so its latency overlaps
            # that kernel's tail and that pass.
            w = tl.load(
                w_rows + (lo + rk)[None, :],
                mask=(rn[:, None] < N) & ((lo + rk)[None, :] < hi),
                other=0.0,
                eviction_policy="evict_first",
            )
            if PDL:
                tl.extra.cuda.gdc_wait()
            inv = _row_inv(x_ptr, rm, rk, M, K, stride_x, eps, NORM_IN, BLOCK_M, BLOCK_K)
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if LATE_NORM:
                x, squares = _x_tile_late(x_ptr, norm_ptr, rm, lo + rk, M, hi, stride_x, dt)
            else:
                x = _x_tile(x_ptr, norm_ptr, inv, rm, lo + rk, M, K, hi, stride_x, dt, NORM_IN, SILU_IN)
            acc = tl.dot(x, tl.trans(w))
            first = lo + BLOCK_K
        else:
            if PDL:
                tl.extra.cuda.gdc_wait()
            inv = _row_inv(x_ptr, rm, rk, M, K, stride_x, eps, NORM_IN, BLOCK_M, BLOCK_K)
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            first = lo
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SILU_OUT
        # the epilogue's other operands, in flight during the main loop
        if ROPE_OUT:
            slot, c1, c2, s1, s2, wa, wb = _rope_operands(
                pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, rm, M, pid_n, NUM_HEADS,
                QK_NORM, BLOCK_N,
            )  # fmt: skip
        if RESIDUAL_OUT:  # written by kernels before this one only (PDL: after gdc_wait above)
            residual = tl.load(
                y_ptr + rm[:, None] * stride_y + rn[None, :],
                mask=(rm[:, None] < M) & (rn[None, :] < N),
                other=0.0,
            ).to(tl.float32)
        for k0 in range(first, hi, BLOCK_K):
            ks = k0 + rk
            if LATE_NORM:
                x, sq = _x_tile_late(x_ptr, norm_ptr, rm, ks, M, hi, stride_x, dt)
                squares += sq
            else:
                x = _x_tile(x_ptr, norm_ptr, inv, rm, ks, M, K, hi, stride_x, dt, NORM_IN, SILU_IN)
            w = tl.load(
                w_rows + ks[None, :],
                mask=(rn[:, None] < N) & (ks[None, :] < hi),
                other=0.0,
                eviction_policy="evict_first",
            )
            acc += tl.dot(x, tl.trans(w))
            if SILU_OUT:
                w_up = tl.load(
                    w_rows + N * stride_w + ks[None, :],
                    mask=(rn[:, None] < N) & (ks[None, :] < hi),
                    other=0.0,
                    eviction_policy="evict_first",
                )
                acc_up += tl.dot(x, tl.trans(w_up))
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K > 1:
            tile = BLOCK_M * N
            tl.store(part_ptr + pid_k * tile + rm[:, None] * N + rn[None, :], acc, mask=out_mask)
            squares_at = part_ptr + SPLIT_K * tile + pid_n * SPLIT_K * BLOCK_M
            if LATE_NORM:
                tl.store(squares_at + pid_k * BLOCK_M + rm, squares)
            if SILU_OUT:  # the up sums after all the gate sums
                up_at = part_ptr + (SPLIT_K + pid_k) * tile + rm[:, None] * N + rn[None, :]
                tl.store(up_at, acc_up, mask=out_mask)
            done = tl.atomic_add(count_ptr + pid_n, 1)
            if done != SPLIT_K - 1:
                return
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(
                    part_ptr + s * tile + rm[:, None] * N + rn[None, :],
                    mask=out_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            if LATE_NORM:
                squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for s in range(SPLIT_K):
                    squares += tl.load(squares_at + s * BLOCK_M + rm, cache_modifier=".cg")
            if SILU_OUT:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):
                    acc_up += tl.load(
                        part_ptr + (SPLIT_K + s) * tile + rm[:, None] * N + rn[None, :],
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
            tl.atomic_xchg(count_ptr + pid_n, 0)
        if LATE_NORM:
            acc = acc * tl.rsqrt(squares / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if SILU_OUT:
                acc_up += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y_at = y_ptr + rm[:, None] * stride_y + rn[None, :]
        if SILU_OUT:  # rounded as the unfused product and silu_mul kernel (triton_fused)
            g = acc.to(dt).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
            tl.store(y_at, (act * acc_up.to(dt).to(tl.float32)).to(dt), mask=out_mask)
        elif ROPE_OUT:
            _rope_store(
                acc.to(dt).to(tl.float32), pid_n, rm, M, y_ptr, k_cache_ptr, v_cache_ptr, slot, c1, c2,
                s1, s2, wa, wb, eps, dt, QK_NORM, NUM_HEADS, NUM_KV_HEADS, BLOCK_M, BLOCK_N,
            )  # fmt: skip
        elif RESIDUAL_OUT:
            tl.store(y_at, (acc.to(dt).to(tl.float32) + residual).to(dt), mask=out_mask)
        else:
            tl.store(y_at, acc.to(dt), mask=out_mask)

    @triton.jit
    def _rope_operands(pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, rm, M, head,
                       NUM_HEADS: tl.constexpr, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
        """What the qkv epilogue reads besides the sums (loaded before the main loop, so that their
        latency hides behind it): each row's cache slot, its rotation's cos and sin halves, and the
        head's q- or k-norm weight halves."""
        HALF: tl.constexpr = HEAD_DIM // 2
        rows = rm < M
        offs = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + rm, mask=rows, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + rm, mask=rows, other=0).to(tl.int64)
        table = pos[:, None] * HEAD_DIM + offs[None, :]
        c1 = tl.load(cos_ptr + table).to(tl.float32)
        c2 = tl.load(cos_ptr + table + HALF).to(tl.float32)
        s1 = tl.load(sin_ptr + table).to(tl.float32)
        s2 = tl.load(sin_ptr + table + HALF).to(tl.float32)
        wa = tl.full((HALF,), 1.0, tl.float32)
        wb = wa
        if QK_NORM:
            is_q = head < NUM_HEADS
            wa = tl.where(is_q, tl.load(q_norm_ptr + offs), tl.load(k_norm_ptr + offs)).to(tl.float32)
            wb = tl.where(is_q, tl.load(q_norm_ptr + HALF + offs), tl.load(k_norm_ptr + HALF + offs))
            wb = wb.to(tl.float32)
        return slot, c1, c2, s1, s2, wa[None, :], wb[None, :]

    @triton.jit
    def _norm_rope_rows(a, b, c1, c2, s1, s2, wa, wb, eps, dt: tl.constexpr, QK_NORM: tl.constexpr,
                        HEAD_DIM: tl.constexpr):  # fmt: skip
        if QK_NORM:
            inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
            a = ((a * inv).to(dt).to(tl.float32) * wa).to(dt).to(tl.float32)
            b = ((b * inv).to(dt).to(tl.float32) * wb).to(dt).to(tl.float32)
        return a * c1 - b * s1, b * c2 + a * s2

    @triton.jit
    def _rope_store(
        acc, head, rm, M, q_ptr, k_cache_ptr, v_cache_ptr, slot, c1, c2, s1, s2, wa, wb, eps,
        dt: tl.constexpr, QK_NORM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        # acc: one head of each row, [BLOCK_M, HEAD_DIM] float32 (already rounded to dt)
        HALF: tl.constexpr = HEAD_DIM // 2
        rows = rm < M
        offs = tl.arange(0, HALF)
        a, b = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        if head < NUM_HEADS:
            a, b = _norm_rope_rows(a, b, c1, c2, s1, s2, wa, wb, eps, dt, QK_NORM, HEAD_DIM)
            dst = q_ptr + (rm[:, None].to(tl.int64) * NUM_HEADS + head) * HEAD_DIM + offs[None, :]
        elif head < NUM_HEADS + NUM_KV_HEADS:
            a, b = _norm_rope_rows(a, b, c1, c2, s1, s2, wa, wb, eps, dt, QK_NORM, HEAD_DIM)
            dst = k_cache_ptr + (slot[:, None] * NUM_KV_HEADS + head - NUM_HEADS) * HEAD_DIM + offs[None, :]
        else:
            kv_head = head - NUM_HEADS - NUM_KV_HEADS
            dst = v_cache_ptr + (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + offs[None, :]
        tl.store(dst, a.to(dt), mask=rows[:, None])
        tl.store(dst + HALF, b.to(dt), mask=rows[:, None])

    @triton.jit
    def _vector_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        part_ptr,
        count_ptr,
        N,
        K,
        stride_w,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        STEPS: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        # One row (batch-1 decode) without tensor cores: each program multiplies a BLOCK_N x span
        # slab of the weight by x element-wise in fp32 and reduces across K once, after the loop.
        # STEPS > 0: the span is STEPS tiles, unrolled, so every tile's load is issued up front (the
        # x slice stays in registers). EVEN: N and K divide into whole tiles (no masks, wide loads).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        dt = y_ptr.dtype.element_ty
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        lo = pid_k * span
        hi = tl.minimum(lo + span, K)
        w_rows = w_ptr + rn[:, None] * stride_w
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if STEPS > 0:
            for i in tl.static_range(STEPS):
                ks = lo + i * BLOCK_K + rk
                if EVEN:
                    x = tl.load(x_ptr + ks)
                    w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
                else:
                    x = tl.load(x_ptr + ks, mask=ks < hi, other=0.0)
                    w = tl.load(
                        w_rows + ks[None, :],
                        mask=(rn[:, None] < N) & (ks[None, :] < hi),
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            for k0 in range(lo, hi, BLOCK_K):
                ks = k0 + rk
                if EVEN:
                    x = tl.load(x_ptr + ks)
                    w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
                else:
                    x = tl.load(x_ptr + ks, mask=ks < hi, other=0.0)
                    w = tl.load(
                        w_rows + ks[None, :],
                        mask=(rn[:, None] < N) & (ks[None, :] < hi),
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, 1)
        n_mask = rn < N
        if SPLIT_K > 1:
            tl.store(part_ptr + pid_k * N + rn, out, mask=n_mask)
            done = tl.atomic_add(count_ptr + pid_n, 1)
            if done != SPLIT_K - 1:
                return
            out = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(SPLIT_K):
                out += tl.load(part_ptr + s * N + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, out.to(dt), mask=n_mask)


# (BLOCK_N, BLOCK_K, SPLIT_K) candidates: the winners of `benchmarks/gpu_gemv.py --sweep` on the
# H200 across the Qwen3-0.6B and 8B projection shapes.
_CANDIDATES = (
    (32, 128, 1),
    (64, 128, 1),
    (64, 256, 1),
    (32, 128, 4),
    (32, 128, 8),
    (64, 128, 4),
    (128, 128, 4),
)
# More candidates at one row (batch-1 decode), as Tiling fields: the fastest of `benchmarks/gpu_gemv.py
# --sweep` (110 tilings, L2-cold) on the H200 at the Qwen3-8B shapes. The one-row vector kernel at
# (16, 512, 1) came within 3% of each shape's best (qkv 14.64 us against 16.0 for the plan the
# L2-warm timing had picked, and cuBLAS 14.68).
_ONE_ROW_CANDIDATES: tuple[tuple, ...] = (
    (16, 512, 1, 4, 3, True),
    (16, 256, 2, 4, 2, True),
    (16, 256, 1, 4, 3, True),
    (32, 256, 1, 8, 3, True),
    (64, 256, 1, 4, 4),
    (128, 128, 4, 4, 4),
    (32, 128, 4, 2, 3),
)
_MAX_SPLIT_TILES = 512  # wider weights have programs enough without split-K
# Timing cycles through copies of a weight that together pass the 50 MB L2, as a decode step reads
# each weight once: replaying one small weight would time it from the L2.
_COLD_BYTES = 96 << 20
# The qkv product with RoPE in its epilogue takes one head per column tile: (BLOCK_K, SPLIT_K).
_ROPE_TILINGS = ((64, 1), (128, 1), (128, 2), (128, 4), (64, 8))


@dataclass(frozen=True)
class Fusion:
    """What a product folds in: RMSNorm of its input, SiLU(gate) * up as its input, the residual
    add of its output, the q/k-norm + RoPE + KV-cache store of a fused qkv."""

    norm: bool = False
    late_norm: bool = False  # the norm's 1/rms applied to the sums (no first pass; not HF's rounding)
    silu: bool = False
    residual: bool = False
    rope: tuple[int, int, int] | None = None  # (num_heads, num_kv_heads, head_dim)
    silu_out: bool = False  # a [gate; up] weight's product returns silu(gate) * up


@dataclass
class RopeStore:
    """The qkv epilogue's operands: q heads normed (``q_norm``) and rotated into ``q_out``, k heads
    normed and rotated into ``k_cache`` at ``slots``, v heads into ``v_cache``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_out: torch.Tensor


class Tiling(NamedTuple):
    """A product's launch: column tile, K tile, K splits, and the kernel's warps and pipeline stages;
    ``vector``: the one-row kernel without tensor cores (``unroll``: its span's tiles unrolled)."""

    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3
    vector: bool = False
    unroll: bool = False


PLAIN = Fusion()
Plan = Tiling
# (N, K, rows bucket, fusion) -> the fastest plan measured in this process, or None where cuBLAS won.
_plans: dict[tuple, Plan | None] = {}
# (N, K, rows bucket) -> the fastest Triton plan of the plain product: a fused variant of it takes
# that tiling (compiling and timing every tiling for every variant would slow the engine's start).
_kernel_plans: dict[tuple, Plan] = {}


def _bucket(rows: int) -> int:
    return 1 if rows == 1 else 4 if rows <= 4 else MAX_ROWS


def candidates(n: int, k: int, fusion: Fusion = PLAIN, rows: int = 0) -> list[Plan]:
    """The tilings timed for a product; ``rows`` 1 (a plain product): the one-row kernel's too."""
    if fusion.rope:
        head_dim = fusion.rope[2]
        fitting = [Tiling(head_dim, bk, split) for bk, split in _ROPE_TILINGS if k // split >= bk]
        return fitting or [Tiling(head_dim, 32, 1)]
    listed = _CANDIDATES + (_ONE_ROW_CANDIDATES if rows == 1 and fusion == PLAIN else ())
    plans = [
        plan
        for plan in (Tiling(*entry) for entry in listed)
        if k // plan.split >= plan.block_k and (plan.split == 1 or -(-n // plan.block_n) <= _MAX_SPLIT_TILES)
    ]
    return plans if plans or fusion == PLAIN else [Tiling(32, 32, 1)]


def rope_fits(head_dim: int) -> bool:
    """Whether the qkv epilogue can take a head of ``head_dim`` as one column tile."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def _graph_time(fn, calls: int = 20) -> float:
    """Seconds per call, replayed from a CUDA graph: eager timing would measure launch cost."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * calls * 1000)


class SkinnyLinear:
    """One weight's product for at most ``MAX_ROWS`` rows. The first call of each row bucket times
    the candidate plans and cuBLAS (outside any graph capture) and keeps the fastest. ``fused``
    folds a decode layer's neighbouring work (``Fusion``) into the product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.contiguous()
        self.bias = bias
        n = self.weight.shape[0]
        self.partials = torch.empty(1, device=weight.device)
        self._retired: list[torch.Tensor] = []  # earlier partials: captured graphs may still use them
        self.counts = torch.zeros(-(-n // 16), dtype=torch.int32, device=weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        plan = self.plan(rows.shape[0])
        if plan is None:
            out = F.linear(rows, self.weight, self.bias)
        else:
            out = self.launch(rows, plan)
        return out.view(*x.shape[:-1], out.shape[-1])

    def fused(
        self,
        rows: torch.Tensor,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        silu: bool = False,
        residual: torch.Tensor | None = None,
        rope: RopeStore | None = None,
        late_norm: bool = False,
    ) -> torch.Tensor:
        """The product of at most ``MAX_ROWS`` contiguous rows with: ``norm`` (an RMSNorm weight):
        of RMSNorm(rows) * norm (``late_norm``: 1/rms applied to the sums, no first pass over the
        rows, not HF's rounding); ``silu``: rows are [gate | up], of silu(gate) * up;
        ``residual``: added into ``residual`` (returned); ``rope``: a fused qkv's heads normed,
        rotated and stored (``rope.q_out`` returned)."""
        heads = (rope.num_heads, rope.num_kv_heads, rope.head_dim) if rope is not None else None
        late = late_norm and norm is not None
        fusion = Fusion(
            norm=norm is not None, late_norm=late, silu=silu, residual=residual is not None, rope=heads
        )
        plan = self.plan(rows.shape[0], fusion)
        if plan is None:  # cuBLAS with torch's element-wise kernels measured faster
            return self._unfused(rows, norm, eps, silu, residual)
        return self.launch(
            rows, plan, norm=norm, eps=eps, silu=silu, residual=residual, rope=rope, late_norm=late
        )

    def silu_gated(self, rows: torch.Tensor, silu_mul) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] weight's product with at most ``MAX_ROWS`` contiguous
        rows: in the product's epilogue, or where that measured slower, the plain product and then
        ``silu_mul(gate_up, out)`` (the unfused kernel, whose roundings the epilogue's follow)."""
        plan = self.plan(rows.shape[0], Fusion(silu_out=True), unfused=silu_mul)
        if plan is not None:
            return self.launch(rows, plan, silu_out=True)
        gate_up = self(rows)
        out = torch.empty(rows.shape[0], gate_up.shape[-1] // 2, dtype=rows.dtype, device=rows.device)
        silu_mul(gate_up, out)
        return out

    def rope_stored(self, rows: torch.Tensor, rope: RopeStore, rope_store) -> None:
        """A fused qkv product of at most ``MAX_ROWS`` contiguous (normed) rows whose epilogue norms,
        rotates and stores its heads (``rope``), or where that measured slower, the plain product
        and then ``rope_store(qkv, rope)`` (the unfused kernel, whose roundings the epilogue's
        follow)."""
        fusion = Fusion(rope=(rope.num_heads, rope.num_kv_heads, rope.head_dim))
        plan = self.plan(rows.shape[0], fusion, unfused=rope_store)
        if plan is not None:
            self.launch(rows, plan, rope=rope)
        else:
            rope_store(self(rows), rope)

    def _unfused(self, rows, norm, eps: float, silu: bool, residual) -> torch.Tensor:
        """``fused`` through cuBLAS and torch, with the same roundings (HF's)."""
        if norm is not None:
            normed = F.rms_norm(rows.float(), (rows.shape[-1],), None, eps).to(rows.dtype)
            rows = (norm * normed).to(rows.dtype)  # a float32 norm weight (Qwen3.5, Nemotron-H) too
        if silu:
            gate, up = rows.chunk(2, dim=-1)
            rows = F.silu(gate) * up
        y = F.linear(rows, self.weight, self.bias)
        return y if residual is None else residual.add_(y)

    def plan(self, rows: int, fusion: Fusion = PLAIN, unfused=None) -> Plan | None:
        """``unfused``: the separate kernel an epilogue fusion (``silu_out``, ``rope`` without
        ``norm``) replaces, timed after the plain product against the fused plans."""
        n, k = self.weight.shape
        key = (n, k, _bucket(rows), fusion)
        if key not in _plans:
            if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: a safe default
                return Tiling(fusion.rope[2] if fusion.rope else 32, 128, 1)
            _plans[key] = self._tune(key[2], fusion, unfused)
        plan = _plans[key]
        if plan is not None:
            self._reserve(plan)
        return plan

    def _tune(self, rows: int, fusion: Fusion, unfused=None) -> Plan | None:
        """The fastest plan; None where cuBLAS is faster (for a fused product: cuBLAS with the
        neighbouring work as torch kernels; for an epilogue fusion given ``unfused``: the plain
        product and that kernel; the qkv epilogue after a norm always runs here)."""
        n, k = self.weight.shape
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        x = torch.randn(rows, 2 * k if fusion.silu else k, **like)
        norm = torch.ones(k, **like) if fusion.norm else None
        residual = torch.zeros(rows, n, **like) if fusion.residual else None
        rope = _scratch_rope(rows, *fusion.rope, like) if fusion.rope else None
        if fusion.silu_out:
            return self._tune_silu_out(x, unfused)
        plans = candidates(n, k, fusion, rows)
        if fusion != PLAIN and not fusion.rope:
            self.plan(rows)  # the plain product's tilings first
            plans = [_kernel_plans.get((n, k, rows), plans[0])]
        copies = self._timing_copies()
        timed = {}
        for plan in plans:
            for lin in copies:
                lin._reserve(plan)
            turn = itertools.cycle(copies)
            timed[plan] = _graph_time(
                lambda plan=plan, turn=turn: next(turn).launch(
                    x,
                    plan,
                    norm=norm,
                    eps=1e-6,
                    silu=fusion.silu,
                    residual=residual,
                    rope=rope,
                    late_norm=fusion.late_norm,
                )
            )
        best = min(timed, key=timed.get) if timed else None
        kernel_plans = [plan for plan in timed if not plan.vector]  # the fused forms' kernel
        if fusion == PLAIN and kernel_plans:
            _kernel_plans[(n, k, rows)] = min(kernel_plans, key=timed.get)
        if fusion.rope and (unfused is None or fusion.norm):
            return best
        turn = itertools.cycle(copies)
        if fusion.rope:  # the plain product (by its own plan), then the unfused kernel
            self.plan(rows)
            separate = _graph_time(lambda: unfused(next(turn)(x), rope))
            return best if best is not None and timed[best] < separate else None
        torch_time = _graph_time(lambda: next(turn)._unfused(x, norm, 1e-6, fusion.silu, residual))
        return best if best is not None and timed[best] < torch_time else None

    def _timing_copies(self) -> list[SkinnyLinear]:
        """This layer and layers of random copies of its weight, ``_COLD_BYTES`` in all (at most 20:
        the calls of one timing)."""
        count = min(20, -(-_COLD_BYTES // (self.weight.numel() * self.weight.element_size())))
        return [self] + [SkinnyLinear(torch.randn_like(self.weight), self.bias) for _ in range(count - 1)]

    def _tune_silu_out(self, x: torch.Tensor, silu_mul) -> Plan | None:
        """The fastest plan of the SiLU epilogue, or None where the plain product (by its own plan)
        and the unfused silu_mul kernel are faster."""
        n, k = self.weight.shape
        copies = self._timing_copies()
        timed = {}
        for plan in candidates(n // 2, k):
            for lin in copies:
                lin._reserve(plan)
            turn = itertools.cycle(copies)
            timed[plan] = _graph_time(lambda plan=plan, turn=turn: next(turn).launch(x, plan, silu_out=True))
        out = torch.empty(x.shape[0], n // 2, dtype=x.dtype, device=x.device)
        self.plan(x.shape[0])  # the plain product's own choice first
        turn = itertools.cycle(copies)
        separate = _graph_time(lambda: silu_mul(next(turn)(x), out))
        best = min(timed, key=timed.get) if timed else None
        return best if best is not None and timed[best] < separate else None

    def _reserve(self, plan: Plan) -> None:
        n, split = self.weight.shape[0], plan[2]
        # split x rows x n partial sums, then (LATE_NORM) split x rows squares per column tile
        need = split * MAX_ROWS * (n + -(-n // plan[0])) if split > 1 else 1
        if self.partials.numel() < need:
            self._retired.append(self.partials)
            self.partials = torch.empty(need, device=self.weight.device)

    def launch(
        self,
        rows: torch.Tensor,
        plan: Plan,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        silu: bool = False,
        residual: torch.Tensor | None = None,
        rope: RopeStore | None = None,
        late_norm: bool = False,
        silu_out: bool = False,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ) -> torch.Tensor:
        """The product by ``plan`` (its warps and stages unless given) with the folded-in work."""
        plan = Tiling(*plan)
        if plan.vector:
            plain = norm is None and not silu and residual is None and rope is None and not silu_out
            assert plain and rows.shape[0] == 1, "the one-row kernel runs plain products of one row"
            return self.launch_vector(rows, plan, num_warps=num_warps, num_stages=num_stages)
        m = rows.shape[0]
        n, k = self.weight.shape
        if silu_out:  # the weight is [gate; up]: y has half its rows' columns
            n //= 2
        block_n, block_k, split = plan[:3]
        if rope is not None:
            y = rope.q_out
            eps = rope.eps
        else:
            y = torch.empty(m, n, dtype=rows.dtype, device=rows.device) if residual is None else residual
        w = self.weight
        r = rope
        launch_pdl = pdl.enabled()
        _skinny_kernel[(-(-n // block_n), split)](
            rows,
            w,
            self.bias if self.bias is not None else w,
            y,
            self.partials,
            self.counts,
            norm if norm is not None else w,
            *(
                (r.positions, r.cos, r.sin, r.q_norm if r.q_norm is not None else w)
                + (r.k_norm if r.k_norm is not None else w, r.slots, r.k_cache, r.v_cache)
                if r is not None
                else (w,) * 8
            ),
            m,
            n,
            k,
            rows.stride(0),
            w.stride(0),
            y.stride(0) if rope is None else 0,
            eps,
            HAS_BIAS=self.bias is not None,
            NORM_IN=norm is not None and not late_norm,
            SILU_IN=silu,
            RESIDUAL_OUT=residual is not None,
            ROPE_OUT=rope is not None,
            QK_NORM=rope is not None and rope.q_norm is not None,
            NUM_HEADS=rope.num_heads if rope else 0,
            NUM_KV_HEADS=rope.num_kv_heads if rope else 0,
            BLOCK_M=MAX_ROWS,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=split,
            PDL=launch_pdl,
            EARLY_TILE=(launch_pdl or (norm is not None and not late_norm)) and not silu_out,
            LATE_NORM=norm is not None and late_norm,
            SILU_OUT=silu_out,
            num_warps=num_warps or plan.num_warps,
            num_stages=num_stages or plan.num_stages,
            launch_pdl=launch_pdl,
        )
        return y

    def launch_vector(
        self, rows: torch.Tensor, plan: Plan, *, unroll: bool | None = None,
        num_warps: int | None = None, num_stages: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One row's product through ``_vector_kernel`` (no tensor cores); ``unroll`` (else the
        plan's): the span's tiles unrolled (their loads issued before the first multiply)."""
        plan = Tiling(*plan)
        unroll = plan.unroll if unroll is None else unroll
        n, k = self.weight.shape
        block_n, block_k, split = plan[:3]
        span = -(-k // (split * block_k)) * block_k
        y = torch.empty(1, n, dtype=rows.dtype, device=rows.device)
        w = self.weight
        _vector_kernel[(-(-n // block_n), split)](
            rows,
            w,
            self.bias if self.bias is not None else w,
            y,
            self.partials,
            self.counts,
            n,
            k,
            w.stride(0),
            HAS_BIAS=self.bias is not None,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=split,
            STEPS=span // block_k if unroll else 0,
            EVEN=n % block_n == 0 and k % (split * block_k) == 0,
            num_warps=num_warps or plan.num_warps,
            num_stages=num_stages or plan.num_stages,
        )
        return y


def _scratch_rope(rows: int, heads: int, kv_heads: int, head_dim: int, like: dict) -> RopeStore:
    """Operands for timing the qkv epilogue (its own caches of ``rows`` slots)."""
    device = like["device"]
    table = torch.ones(1, head_dim, **like)
    norm = torch.ones(head_dim, **like)
    return RopeStore(
        heads, kv_heads, head_dim, torch.zeros(rows, dtype=torch.long, device=device), table, table,
        norm, norm, 1e-6, torch.arange(rows, device=device),
        torch.empty(rows, kv_heads, head_dim, **like), torch.empty(rows, kv_heads, head_dim, **like),
        torch.empty(rows, heads, head_dim, **like),
    )  # fmt: skip


def usable(weight: torch.Tensor) -> bool:
    return (
        available()
        and weight.is_cuda
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.shape[1] % 16 == 0
    )
