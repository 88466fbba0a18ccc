"""Triton kernels for CUDA: paged decode attention (GQA). The torch reference in attention.py is
their oracle. Importable without Triton (the CPU build has none); ``available()`` says whether
they can run."""

from __future__ import annotations

import torch

from trtedge.runtime.ops import kv_fp8, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _load_kv(
        k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, rows, valid, offs_d, dtype: tl.constexpr,
        HEAD_DIM: tl.constexpr, FP8_KV: tl.constexpr,
    ):  # fmt: skip
        """Keys and values of cache ``rows`` (slot * heads + head) in ``dtype``; FP8_KV (the layout of
        ``kv_fp8``: E4M3 bytes then a float32 scale per row): also each row's two scales."""
        if FP8_KV:
            width: tl.constexpr = HEAD_DIM + 4
            offs = rows.to(tl.int64)[:, None] * width + offs_d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(dtype)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(dtype)
            at = rows.to(tl.int64) * (width // 4) + HEAD_DIM // 4
            k_scale = tl.load(k_scale_ptr + at, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + at, mask=valid, other=0.0)
        else:
            offs = rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            k_scale = valid.to(tl.float32)  # unused: the caller multiplies only under FP8_KV
            v_scale = k_scale
        return k, v, k_scale, v_scale

    @triton.jit
    def _load_kv_variant(
        k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, rows, valid, offs_d, dtype: tl.constexpr,
        HEAD_DIM: tl.constexpr, LAYOUT: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr,
    ):  # fmt: skip
        """The fp8 cache read of the benchmark's variants: LAYOUT 0 as kv_fp8 (each row's bytes then its
        scale); 1 each block's values first, then its scales (rows aligned to 16 bytes)."""
        width: tl.constexpr = HEAD_DIM + 4
        r = rows.to(tl.int64)
        if LAYOUT == 0:
            offs = r[:, None] * width + offs_d[None, :]
            at = r * (width // 4) + HEAD_DIM // 4
        else:
            blk = r // ROWS_PER_BLOCK
            i = r % ROWS_PER_BLOCK
            base = tl.multiple_of(blk * (ROWS_PER_BLOCK * width) + i * HEAD_DIM, 16)
            offs = base[:, None] + offs_d[None, :]
            at = blk * (ROWS_PER_BLOCK * width // 4) + ROWS_PER_BLOCK * HEAD_DIM // 4 + i
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(dtype)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(dtype)
        k_scale = tl.load(k_scale_ptr + at, mask=valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + at, mask=valid, other=0.0)
        return k, v, k_scale, v_scale

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        tables_ptr,
        context_lens_ptr,
        out_ptr,
        tables_stride,
        scale,
        FP8_KV: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLIT_TOKENS: tl.constexpr,
        WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        PDL: tl.constexpr,
        FP8_VARIANT: tl.constexpr,
        ROWS_PER_BLOCK: tl.constexpr,
    ):
        # One program per (sequence, kv head, context split): all query heads of the group share
        # each K/V load. With splits, each program writes a partial softmax state that
        # _merge_splits_kernel combines (more programs in flight for small batches).
        if PDL:  # (see ops.pdl)
            tl.extra.cuda.gdc_wait()
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(context_lens_ptr + seq)
        first = 0
        if WINDOW > 0:  # a sliding-window layer sees only the WINDOW most recent keys
            first = tl.maximum(ctx - WINDOW, 0)
        if SPLIT_TOKENS > 0:  # fixed-length splits: long contexts spread over more programs
            chunk = SPLIT_TOKENS
        else:  # the context cut into NUM_SPLITS equal parts
            chunk = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * chunk
        hi = tl.minimum(lo + chunk, ctx)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + offs_g
        q_mask = offs_g[:, None] < GROUP
        q = tl.load(
            q_ptr + (seq * NUM_HEADS + heads)[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            block = tl.load(tables_ptr + seq * tables_stride + offs_n // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            if FP8_VARIANT > 0:
                k, v, k_scale, v_scale = _load_kv_variant(
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot * NUM_KV_HEADS + kv_head,
                    valid, offs_d, q.dtype, HEAD_DIM, FP8_VARIANT - 1, ROWS_PER_BLOCK,
                )  # fmt: skip
            else:
                k, v, k_scale, v_scale = _load_kv(
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot * NUM_KV_HEADS + kv_head, valid,
                    offs_d, q.dtype, HEAD_DIM, FP8_KV,
                )  # fmt: skip
            if IEEE:  # float32 caches: exact products, not tf32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            if FP8_KV:
                s = s * k_scale[None, :]
            if SOFTCAP > 0:  # SOFTCAP * tanh(s / SOFTCAP)
                s = SOFTCAP * (2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            if FP8_KV:
                p = p * v_scale[None, :]  # after the sum: a value's scale weighs its row, not the softmax
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if NUM_SPLITS == 1:
            out = acc / denom[:, None]
            tl.store(
                out_ptr + (seq * NUM_HEADS + heads)[:, None] * HEAD_DIM + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=q_mask,
            )
        else:
            row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
            tl.store(part_m_ptr + row, m, mask=offs_g < GROUP)
            tl.store(part_l_ptr + row, denom, mask=offs_g < GROUP)
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)

    @triton.jit
    def _merge_splits_kernel(
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        out_ptr,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)  # sequence x head
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        m = tl.load(part_m_ptr + row * NUM_SPLITS + offs_s)
        denom = tl.load(part_l_ptr + row * NUM_SPLITS + offs_s)
        acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :])
        weight = tl.exp(m - tl.max(m, 0))  # empty splits have m = -inf: weight 0
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(denom * weight, 0)
        tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


def kv_scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 views of fp8 caches (where the kernels read each row's scale); else the caches."""
    if not kv_fp8.is_fp8(k_cache):
        return k_cache, v_cache
    return k_cache.view(torch.float32), v_cache.view(torch.float32)


def num_splits(batch: int, kv_heads: int) -> int:
    """Context splits so that a small batch still has ~128 programs in flight (a power of two)."""
    target = max(1, 128 // max(1, batch * kv_heads))
    return min(16, 1 << (target.bit_length() - 1))


def default_tiling(batch: int, kv_heads: int, head_dim: int, fp8: bool) -> tuple[int, int, int]:
    """(equal splits, fixed split length in tokens or 0, BLOCK_N) for a launch of ``batch`` rows,
    from the sweeps of ``benchmarks/gpu_decode_attention.py`` on the H200 (Qwen3-0.6B's 8 KV heads
    of 128, the KV lengths of nano-vllm's workload): up to 127 programs (batch x KV heads), equal
    splits toward 128 programs; up to 511, fixed splits of 256 tokens, so that the long contexts of
    a batch no longer set the launch's time alone (batch 16: 49.7 -> 22.8 us); up to 2,047, two
    equal splits of 128-key tiles (batch 128: 128.2 -> 115.0 us); past that, no split and 128-key
    tiles (batch 256: 227.9 -> 214.8 us). Wider heads and the fp8 cache keep 64-key tiles."""
    programs = batch * kv_heads
    wide_tiles = 128 if head_dim <= 128 and not fp8 else 64
    if programs < 128:
        return num_splits(batch, kv_heads), 0, 64
    if programs < 512:
        return 0, 256, 64
    if programs < 2048:
        return (2, 0, wide_tiles) if not fp8 else (1, 0, 64)
    return 1, 0, wide_tiles


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] int32/int64
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float | None = None,
    *,
    splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_variant: int = 0,
) -> torch.Tensor:
    """``window`` > 0: attend to the last ``window`` keys only; ``softcap``: tanh-capped scores.
    ``splits`` (-N: fixed splits of N tokens), ``block_n``, ``num_warps``, ``num_stages``: the
    launch's tiling (None: the default for the shape; ``benchmarks/gpu_decode_attention.py`` sweeps
    them); ``fp8_variant`` (the benchmark's): 1 + the layout of ``_load_kv_variant``."""
    q = q.contiguous()  # the kernel addresses [B, H, D] densely (Nemotron-H's q is a view of its qkv)
    b, h, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = h // hkv
    fp8 = kv_fp8.is_fp8(k_cache)
    out = torch.empty_like(q) if out is None else out
    split_tokens = 0
    if splits is None:
        splits, split_tokens, default_n = default_tiling(b, hkv, d, fp8)
        block_n = default_n if block_n is None else block_n
    elif splits < 0:  # -N: fixed splits of N tokens (the benchmark's sweep)
        split_tokens = -splits
    block_n = 64 if block_n is None else block_n
    if split_tokens:
        reach = tables.shape[1] * block_size  # the longest context the tables can hold
        splits = triton.next_power_of_2(-(-min(reach, window or reach) // split_tokens))
        split_tokens = split_tokens if splits > 1 else 0
    launch_pdl = pdl.enabled()
    if splits > 1:
        part_m = torch.empty(b * h * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(b * h * splits, d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out
    _paged_decode_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        *kv_scale_views(k_cache, v_cache),
        tables,
        context_lens,
        out,
        tables.stride(0),
        scale,
        FP8_KV=fp8,
        NUM_HEADS=h,
        NUM_KV_HEADS=hkv,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        NUM_SPLITS=splits,
        SPLIT_TOKENS=split_tokens,
        WINDOW=window,
        SOFTCAP=float(softcap or 0.0),
        part_m_ptr=part_m,
        part_l_ptr=part_l,
        part_acc_ptr=part_acc,
        PDL=launch_pdl,
        FP8_VARIANT=fp8_variant if fp8 else 0,
        ROWS_PER_BLOCK=block_size * hkv,
        launch_pdl=launch_pdl,
        **({} if num_warps is None else {"num_warps": num_warps}),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if splits > 1:
        _merge_splits_kernel[(b * h,)](
            part_m,
            part_l,
            part_acc,
            out,
            NUM_SPLITS=splits,
            HEAD_DIM=d,
            PDL=launch_pdl,
            launch_pdl=launch_pdl,
        )
    return out
