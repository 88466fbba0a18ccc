"""Triton kernels for the CUDA decode step: fused residual-add + RMSNorm, q/k-norm + RoPE + KV-cache
store, SiLU-mul. They replace a dozen small torch kernels per layer. Roundings follow HF
transformers (normalise in float32, round to the model dtype, then scale)."""

from __future__ import annotations

import torch

from trtedge.runtime.ops import pdl
from trtedge.runtime.ops.triton_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        delta_ptr,
        w_ptr,
        out_ptr,
        dim,
        eps,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # (see ops.pdl)
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < dim
        x = tl.load(x_ptr + row * dim + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * dim + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * dim + offs, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
        y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope(
        a,
        b,
        w_ptr,
        cos_ptr,
        sin_ptr,
        pos,
        eps,
        offs,
        DT: tl.constexpr,
        HAS_NORM: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
    ):
        # a, b: [heads, HALF] float32, the halves of each head's row; offs: [HALF]
        if HAS_NORM:
            inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
            a = (a * inv).to(DT).to(tl.float32) * tl.load(w_ptr + offs).to(tl.float32)[None, :]
            b = (b * inv).to(DT).to(tl.float32) * tl.load(w_ptr + HALF + offs).to(tl.float32)[None, :]
            a = a.to(DT).to(tl.float32)
            b = b.to(DT).to(tl.float32)
        c1 = tl.load(cos_ptr + pos * HEAD_DIM + offs).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + pos * HEAD_DIM + HALF + offs).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + pos * HEAD_DIM + offs).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + pos * HEAD_DIM + HALF + offs).to(tl.float32)[None, :]
        return a * c1 - b * s1, b * c2 + a * s2

    @triton.jit
    def _qkv_rope_store_kernel(
        qkv_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        q_norm_ptr,
        k_norm_ptr,
        slot_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        q_out_ptr,
        eps,
        FP8_KV: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
        Q_HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
    ):
        # One program per (token, part): part 0 the token's q heads, 1 its k heads, 2 its v heads of
        # the fused projection, each part's heads as one [heads, HEAD_DIM] tile (Q_HEADS / KV_HEADS:
        # the head counts rounded up to a power of two).
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        offs = tl.arange(0, HALF)
        dt = q_out_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + t)
        slot = tl.load(slot_ptr + t)
        if part == 0:  # (names of its own: the branches' tiles differ in shape)
            q_heads = tl.arange(0, Q_HEADS)
            q_mask = (q_heads < NUM_HEADS)[:, None]
            q_src = qkv_ptr + t * width + q_heads[:, None] * HEAD_DIM + offs[None, :]
            qa = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
            qb = tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
            q1, q2 = _norm_rope(
                qa, qb, q_norm_ptr, cos_ptr, sin_ptr, pos, eps, offs, dt, HAS_NORM, HEAD_DIM, HALF
            )
            q_dst = q_out_ptr + (t * NUM_HEADS + q_heads[:, None]) * HEAD_DIM + offs[None, :]
            tl.store(q_dst, q1.to(dt), mask=q_mask)
            tl.store(q_dst + HALF, q2.to(dt), mask=q_mask)
        else:
            heads = tl.arange(0, KV_HEADS)
            valid = heads < NUM_KV_HEADS
            mask = valid[:, None]
            first = NUM_HEADS + (part - 1) * NUM_KV_HEADS
            src = qkv_ptr + t * width + (first + heads[:, None]) * HEAD_DIM + offs[None, :]
            rows = slot * NUM_KV_HEADS + heads
            if part == 1:
                a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                b = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
                o1, o2 = _norm_rope(
                    a, b, k_norm_ptr, cos_ptr, sin_ptr, pos, eps, offs, dt, HAS_NORM, HEAD_DIM, HALF
                )
                if FP8_KV:
                    _store_fp8_rows(
                        k_cache_ptr, k_scale_ptr, rows, o1.to(dt), o2.to(dt), offs, valid, HEAD_DIM
                    )
                else:
                    dst = k_cache_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + offs[None, :]
                    tl.store(dst, o1.to(dt), mask=mask)
                    tl.store(dst + HALF, o2.to(dt), mask=mask)
            else:
                v1 = tl.load(src, mask=mask, other=0.0)
                v2 = tl.load(src + HALF, mask=mask, other=0.0)
                if FP8_KV:
                    _store_fp8_rows(v_cache_ptr, v_scale_ptr, rows, v1, v2, offs, valid, HEAD_DIM)
                else:
                    dst = v_cache_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + offs[None, :]
                    tl.store(dst, v1, mask=mask)
                    tl.store(dst + HALF, v2, mask=mask)

    @triton.jit
    def _store_fp8_rows(cache_ptr, scale_ptr, rows, a, b, offs, valid, HEAD_DIM: tl.constexpr):
        """(slot, head) rows ``rows`` (those ``valid``), halves ``a`` and ``b`` ([rows, HALF]), in the
        fp8 layout of ``kv_fp8``."""
        HALF: tl.constexpr = HEAD_DIM // 2
        width: tl.constexpr = HEAD_DIM + 4
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a), 1), tl.max(tl.abs(b), 1))
        scale = tl.maximum(amax, 1e-30) / 448.0
        base = rows.to(tl.int64) * width
        dst = cache_ptr + base[:, None] + offs[None, :]
        qa = tl.clamp(a / scale[:, None], -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        qb = tl.clamp(b / scale[:, None], -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(dst, qa, mask=valid[:, None])
        tl.store(dst + HALF, qb, mask=valid[:, None])
        tl.store(scale_ptr + rows.to(tl.int64) * (width // 4) + HEAD_DIM // 4, scale, mask=valid)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(gate_up_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(out_ptr + row * inter + offs, (act * u).to(dt), mask=mask)


class TritonDecodeKernels:
    """The decode-step kernels for CUDA, with the same calls as the native CPU set."""

    def add_rms_norm(self, x, delta, weight, out, eps: float) -> None:
        rows, dim = x.shape
        _add_rms_norm_kernel[(rows,)](
            x,
            x if delta is None else delta,
            weight,
            out,
            dim,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(dim),
            PDL=pdl.enabled(),
            launch_pdl=pdl.enabled(),
        )

    def qkv_rope_store(
        self,
        qkv,
        num_heads,
        num_kv_heads,
        head_dim,
        positions,
        cos,
        sin,
        q_norm,
        k_norm,
        eps,
        slots,
        k_cache,
        v_cache,
        q_out,
    ) -> None:
        from trtedge.runtime.ops.triton_attention import kv_scale_views

        grid = (qkv.shape[0], 3)
        _qkv_rope_store_kernel[grid](
            qkv,
            positions,
            cos,
            sin,
            q_norm if q_norm is not None else cos,
            k_norm if k_norm is not None else cos,
            slots,
            k_cache,
            v_cache,
            *kv_scale_views(k_cache, v_cache),
            q_out,
            eps,
            FP8_KV=k_cache.dtype == torch.uint8,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HALF=head_dim // 2,
            HAS_NORM=q_norm is not None,
            Q_HEADS=triton.next_power_of_2(num_heads),
            KV_HEADS=triton.next_power_of_2(num_kv_heads),
        )

    def rope_store(self, qkv, store) -> None:
        """``qkv_rope_store`` with its operands from a ``triton_gemv.RopeStore``."""
        r = store
        self.qkv_rope_store(
            qkv, r.num_heads, r.num_kv_heads, r.head_dim, r.positions, r.cos, r.sin, r.q_norm,
            r.k_norm, r.eps, r.slots, r.k_cache, r.v_cache, r.q_out,
        )  # fmt: skip

    def paged_decode_attention(
        self, q, k_cache, v_cache, tables, context_lens, block_size, scale, out, window: int = 0
    ) -> None:
        from trtedge.runtime.ops.triton_attention import paged_decode_attention

        paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, out, window=window)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        rows, inter = out.shape
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
