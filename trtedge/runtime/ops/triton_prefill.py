"""Triton varlen prefill attention over the paged KV cache (causal, with reused prefixes).

All sequences of a step go in one launch: the host cuts each sequence's new query rows into
tiles of ``BLOCK_M``; a program attends one tile for one query head to every cached key at or
before each row's position (the reused prefix and this step's keys, already stored). The torch
reference (``TorchAttention``) is the oracle."""

from __future__ import annotations

import torch

from trtedge.runtime.ops import kv_fp8
from trtedge.runtime.ops.triton_attention import kv_scale_views, triton

BLOCK_M = 64

if triton is not None:
    import triton.language as tl

    from trtedge.runtime.ops.triton_attention import _load_kv

    # tables_stride varies with the step's longest block table: one compiled variant serves them all
    @triton.jit(do_not_specialize=["tables_stride"])
    def _paged_prefill_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        tables_ptr,
        tiles_ptr,  # [num_tiles, 2] int32: sequence index, first row of the tile within the sequence
        seqs_ptr,  # [num_seqs, 3] int32: first query row in q, number of query rows, context length
        out_ptr,
        tables_stride,
        scale,
        FP8_KV: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        seq = tl.load(tiles_ptr + tile * 2)
        row0 = tl.load(tiles_ptr + tile * 2 + 1)
        q_start = tl.load(seqs_ptr + seq * 3)
        q_len = tl.load(seqs_ptr + seq * 3 + 1)
        ctx = tl.load(seqs_ptr + seq * 3 + 2)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        rows_valid = offs_m < q_len
        positions = ctx - q_len + offs_m
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + (q_rows * NUM_HEADS + head)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=rows_valid[:, None],
            other=0.0,
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        hi = tl.minimum(ctx, ctx - q_len + row0 + BLOCK_M)  # keys past the tile's last row stay unread
        lo = 0
        if WINDOW > 0:  # keys before the first row's window are invisible to the whole tile
            lo = tl.maximum(ctx - q_len + row0 - WINDOW + 1, 0)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            keys_valid = offs_n < hi
            block = tl.load(tables_ptr + seq * tables_stride + offs_n // BLOCK_SIZE, mask=keys_valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            k, v, k_scale, v_scale = _load_kv(
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot * NUM_KV_HEADS + kv_head,
                keys_valid, offs_d, q.dtype, HEAD_DIM, FP8_KV,
            )  # fmt: skip
            if IEEE:  # float32 caches: exact products, not tf32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            if FP8_KV:
                s = s * k_scale[None, :]
            if SOFTCAP > 0:  # SOFTCAP * tanh(s / SOFTCAP)
                s = SOFTCAP * (2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0)
            visible = keys_valid[None, :] & (offs_n[None, :] <= positions[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > positions[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            if FP8_KV:
                p = p * v_scale[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        out = acc / denom[:, None]
        tl.store(
            out_ptr + (q_rows * NUM_HEADS + head)[:, None] * HEAD_DIM + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rows_valid[:, None],
        )


def supported(head_dim: int) -> bool:
    return triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def plan_tiles(query_lens: list[int], context_lens: list[int]) -> tuple[list[int], list[int]]:
    """Host-side launch description: flat (sequence, first row) per tile and (start, len, ctx) per
    sequence, both int32 lists."""
    tiles: list[int] = []
    seqs: list[int] = []
    start = 0
    for index, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        for row in range(0, qlen, BLOCK_M):
            tiles += (index, row)
        seqs += (start, qlen, ctx)
        start += qlen
    return tiles, seqs


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: this step's query rows, sequence after sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] holding this step's keys already
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    tiles: torch.Tensor,  # [num_tiles, 2] int32 from plan_tiles
    seqs: torch.Tensor,  # [num_seqs, 3] int32 from plan_tiles
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``window`` > 0: each row sees its ``window`` most recent keys; ``softcap``: tanh-capped scores.
    ``q`` may be a strided view (a split of a fused qkv projection): the kernel reads a contiguous copy."""
    q = q.contiguous()  # the kernel addresses [T, H, D] densely (Nemotron-H's q is a view of its qkv)
    t, h, d = q.shape
    out = torch.empty_like(q)
    _paged_prefill_kernel[(tiles.shape[0], h)](
        q,
        k_cache,
        v_cache,
        *kv_scale_views(k_cache, v_cache),
        tables,
        tiles,
        seqs,
        out,
        tables.stride(0),
        scale,
        FP8_KV=kv_fp8.is_fp8(k_cache),
        NUM_HEADS=h,
        NUM_KV_HEADS=k_cache.shape[2],
        HEAD_DIM=d,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=BLOCK_M,
        BLOCK_N=64 if q.dtype != torch.float32 else 32,
        IEEE=q.dtype == torch.float32,
        WINDOW=window,
        SOFTCAP=float(softcap or 0.0),
        num_warps=4,
        num_stages=2,
    )
    return out
