"""Qwen3.5's gated attention before the attention kernel, in one launch (CUDA, Triton): q and k of
each head out of the qkv projection (q interleaved with the output gate per head), RMSNorm with
the head's norm weight, rotary on the first ``rd`` channels (half-rotation layout). The torch code
in models/qwen3_5.py (``GatedAttention.attend``) is the oracle; the roundings are its own (normed,
then each rotary product and their sum, in the activations' dtype). Importable without Triton."""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,  # [T, 2 * H * D + 2 * KV * D]: per head q then gate, then k, then v
        cos_ptr,  # [T, RD]
        sin_ptr,  # [T, RD]
        q_norm_ptr,  # [D] float32
        k_norm_ptr,  # [D] float32
        q_ptr,  # [T, H, D]
        k_ptr,  # [T, KV, D]
        qkv_stride,
        eps,
        H,
        KV,
        D: tl.constexpr,
        RD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        head = tl.program_id(1)
        dt = q_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        is_q = head < H
        src = tl.where(is_q, head * 2 * D, 2 * H * D + (head - H) * D)
        row = qkv_ptr + t * qkv_stride + src
        x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.where(
            is_q,
            tl.load(q_norm_ptr + offs, mask=mask, other=0.0),
            tl.load(k_norm_ptr + offs, mask=mask, other=0.0),
        )
        normed = (x * inv * w).to(dt).to(tl.float32)
        half = RD // 2
        partner = tl.where(offs < half, offs + half, offs - half)
        in_rope = offs < RD
        xp = tl.load(row + partner, mask=mask & in_rope, other=0.0).to(tl.float32)
        wp = tl.where(
            is_q,
            tl.load(q_norm_ptr + partner, mask=mask & in_rope, other=0.0),
            tl.load(k_norm_ptr + partner, mask=mask & in_rope, other=0.0),
        )
        rotated = (xp * inv * wp).to(dt).to(tl.float32)
        rotated = tl.where(offs < half, -rotated, rotated)
        c = tl.load(cos_ptr + t * RD + offs, mask=mask & in_rope, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * RD + offs, mask=mask & in_rope, other=0.0).to(tl.float32)
        roped = (normed * c).to(dt).to(tl.float32) + (rotated * s).to(dt).to(tl.float32)
        out = tl.where(in_rope, roped, normed).to(dt)
        tl.store(q_ptr + (t * H + head) * D + offs, out, mask=mask & is_q)
        tl.store(k_ptr + (t * KV + head - H) * D + offs, out, mask=mask & (head >= H))


def qk_norm_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, H, D], k [T, KV, D]) normed and rotated, from ``qkv`` [T, ...] and ``cos``/``sin``
    [T, rd] (or [T, 1, rd])."""
    t = qkv.shape[0]
    rd = cos.shape[-1]
    cos, sin = cos.reshape(t, rd).contiguous(), sin.reshape(t, rd).contiguous()
    if qkv.stride(-1) != 1:
        raise ValueError("internal error: qkv needs unit stride along its last dim")
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_kernel[(t, num_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        q_norm,
        k_norm,
        q,
        k,
        qkv.stride(0),
        eps,
        num_heads,
        num_kv_heads,
        D=head_dim,
        RD=rd,
        BLOCK=triton.next_power_of_2(head_dim),
    )
    return q, k
