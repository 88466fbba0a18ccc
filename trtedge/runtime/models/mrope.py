"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL text models.

Each token has three positions (temporal, height, width). Text tokens have all three equal and
counting up; the tokens of an image or video take their patch coordinates (after the spatial merge)
offset by the position where the item starts, the temporal one scaled by ``tokens_per_second`` x
seconds per temporal patch for video; text after an item continues at the item's largest position
+ 1. The rotary frequencies of a head are split in ``mrope_section`` (temporal, height, width)
sections, each rotated by its own position. Generated tokens sit at ``index + rope_delta`` on all
three axes, which is plain 1D rotary: decode runs the text model's own path unchanged.
"""

from __future__ import annotations

import torch

from trtedge.runtime.models.llama import LlamaModel

# (offset of the item's first token, (t, h, w) of its merged grid, temporal position step)
Span = tuple[int, tuple[int, int, int], float]


def mrope_positions(num_tokens: int, spans: list[Span]) -> tuple[torch.Tensor, int]:
    """(3, num_tokens) positions of a prompt and its rope delta (next position - num_tokens)."""
    pos = torch.empty(3, num_tokens, dtype=torch.long)
    index = start = 0  # next token index, next text position
    for offset, (t, h, w), step in sorted(spans):
        pos[:, index:offset] = torch.arange(offset - index) + start
        start += offset - index
        end = offset + t * h * w
        grid = torch.stack(
            torch.meshgrid((torch.arange(t) * step).long(), torch.arange(h), torch.arange(w), indexing="ij")
        )
        pos[:, offset:end] = grid.reshape(3, -1) + start
        start = int(pos[:, offset:end].max()) + 1 if end > offset else start
        index = end
    pos[:, index:] = torch.arange(num_tokens - index) + start
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


class MropeModel(LlamaModel):
    """A qwen2-style decoder whose prefill takes (3, T) positions; (T,) positions are 1D rotary."""

    def __init__(self, cfg, tensors, dtype, device, weight_format: str = "float", max_positions: int = 8192):
        # media positions may run ahead of the token count (a video's temporal step): larger tables
        super().__init__(cfg, tensors, dtype, device, weight_format, 4 * max_positions)
        half = cfg.head_dim // 2
        section = list(cfg.mrope_section)
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must add up to head_dim / 2 = {half}")
        if cfg.mrope_interleaved:  # t everywhere but every third frequency from 1 (h) and from 2 (w)
            axis = torch.zeros(half, dtype=torch.long)
            axis[1 : section[1] * 3 : 3] = 1
            axis[2 : section[2] * 3 : 3] = 2
        else:
            axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
        self.mrope_axis = torch.cat([axis, axis]).to(device)  # which position rotates each dimension

    def rope_for(self, positions: torch.Tensor) -> dict:
        if positions.dim() == 1:
            return super().rope_for(positions)
        cos, sin = self.rope["global"]
        dims = torch.arange(cos.shape[-1], device=cos.device)
        rows = positions[self.mrope_axis]  # (head_dim, T): the position each dimension rotates by
        c = cos[rows, dims[:, None]].T.unsqueeze(1)
        s = sin[rows, dims[:, None]].T.unsqueeze(1)
        return {"global": (c, s)}
