"""Rotary position embeddings: inverse frequencies for each scaling kind and the cos/sin tables.

Partial rotary (only the first ``rotary_dim`` of each head rotated, as Phi models may set) uses the
full-head rotate-half layout of the kernels: the q/k projection rows of each head are permuted so
that rotated pairs sit at (i, i + head_dim / 2), and the other dimensions get cos 1, sin 0.
Queries and keys are permuted alike, so their dot products are unchanged.
"""

from __future__ import annotations

import math

import torch

from trtedge.runtime.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, dim: int, max_positions: int) -> torch.Tensor:
    if rope.kind == "proportional":  # exponents over the whole head; the pairs past the share stay still
        pairs = int(rope.partial_rotary_factor * dim // 2)
        inv_freq = torch.zeros(dim // 2)
        exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.int64).float() / dim
        inv_freq[:pairs] = 1.0 / rope.theta**exponents
        return inv_freq / rope.factor
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.kind == "longrope":
        # One set for the whole run, as llama.cpp does: the long factors when the engine's context
        # goes past the original training length (HF switches per forward call instead, which would
        # leave earlier cached keys rotated with the other set).
        long = max_positions > rope.original_max_position_embeddings
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"longrope factors have {factors.numel()} entries; expected {inv_freq.numel()}")
        return inv_freq / factors
    return inv_freq


def rope_tables(
    rope: RopeConfig, head_dim: int, rotary_dim: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [max_positions, head_dim] in the rotate-half layout (see the module doc)."""
    inv_freq = rope_inv_freq(rope, rotary_dim, max_positions)
    half = torch.zeros(head_dim // 2)
    half[: rotary_dim // 2] = inv_freq
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), half)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = torch.ones(head_dim // 2)
    scale[: rotary_dim // 2] = rope.attention_factor  # dimensions that are not rotated stay as they are
    scale = torch.cat((scale, scale))
    return emb.cos() * scale, emb.sin() * scale


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Source index of each dimension of a head in the layout where rotated pairs sit half a head apart."""
    r, h = rotary_dim // 2, head_dim // 2
    rest = list(range(rotary_dim, head_dim))
    order = list(range(r)) + rest[: h - r] + list(range(r, rotary_dim)) + rest[h - r :]
    return torch.tensor(order)


def permute_heads(w: torch.Tensor, num_heads: int, order: torch.Tensor) -> torch.Tensor:
    """Reorder the dimensions inside each head of a projection's output rows (or of a per-head vector)."""
    if w.shape[0] == order.numel():
        return w[order]
    head_dim = order.numel()
    return w.reshape(num_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)
