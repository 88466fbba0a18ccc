"""Qwen2.5-VL: the vision encoder, and the model that pairs it with its M-RoPE text decoder.

The encoder reads patches in the processor's layout (``runtime.multimodal.processor``): a linear
patch embedding (the checkpoint's Conv3d over channels x temporal_patch_size x patch_size^2, as
one matrix), transformer blocks (RMSNorm, attention with a 2D rotary over each patch's (row,
column), SwiGLU MLP) that attend within windows of ``window_size`` pixels except the
``fullatt_block_indexes`` blocks, which attend over the whole frame, then the patch merger
(RMSNorm, each merge_size^2 block of patches concatenated, two linear layers with GELU) down to
one row per placeholder token in the text model's width. Windows are formed over merged blocks,
so the tokens run in window order inside the encoder and are put back in raster order at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import ACTIVATIONS, rename_prefix, require, rms_norm
from trtedge.runtime.models.mrope import MropeModel

VISION_PREFIXES = ("visual.", "model.visual.")
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.": ""}
_EPS = 1e-6


def is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: float = 4.0
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    image_token_id: int = 151655
    video_token_id: int = 151656

    @classmethod
    def from_hf(cls, cfg: dict) -> VisionConfig:
        """From the model's config.json (its ``vision_config`` and the placeholder token ids)."""
        v = cfg.get("vision_config") or {}
        try:
            return cls(
                depth=int(v["depth"]),
                hidden_size=int(v["hidden_size"]),
                intermediate_size=int(v["intermediate_size"]),
                num_heads=int(v["num_heads"]),
                out_hidden_size=int(v["out_hidden_size"]),
                patch_size=int(v.get("patch_size", 14)),
                spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                window_size=int(v.get("window_size", 112)),
                fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
                tokens_per_second=float(v.get("tokens_per_second", 4)),
                in_channels=int(v.get("in_channels", 3)),
                hidden_act=str(v.get("hidden_act", "silu")),
                rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                image_token_id=int(cfg.get("image_token_id", 151655)),
                video_token_id=int(cfg.get("video_token_id", 151656)),
            )
        except KeyError as e:
            raise ValueError(f"config.json vision_config: missing required field {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class _Linear:
    def __init__(self, w: dict, name: str):
        self.weight = require(w, name + ".weight")
        self.bias = w.get(name + ".bias")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class VisionBlock:
    def __init__(self, cfg: VisionConfig, w: dict, full: bool):
        self.cfg = cfg
        self.full = full
        self.norm1 = require(w, "norm1.weight")
        self.norm2 = require(w, "norm2.weight")
        self.qkv = _Linear(w, "attn.qkv")
        self.proj = _Linear(w, "attn.proj")
        self.gate, self.up, self.down = (_Linear(w, f"mlp.{n}_proj") for n in ("gate", "up", "down"))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x, cos, sin, frames: list[int], windows: list[int]) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        q, k, v = self.qkv(rms_norm(x, self.norm1, _EPS)).view(n, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = segment_attention(q, k, v, frames if self.full else windows)
        x = x + self.proj(o.reshape(n, -1))
        h = rms_norm(x, self.norm2, _EPS)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


class Qwen25VisionEncoder:
    """Patches of a batch of images / videos -> one embedding per placeholder token, in item order."""

    def __init__(self, cfg: VisionConfig, tensors: dict[str, torch.Tensor], dtype, device):
        self.cfg = cfg
        self.dtype, self.device = dtype, device
        w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        patch = require(w, "patch_embed.proj.weight")
        self.patch_embed = patch.reshape(patch.shape[0], -1)
        self.blocks = [
            VisionBlock(cfg, _sub(w, f"blocks.{i}."), i in cfg.fullatt_block_indexes)
            for i in range(cfg.depth)
        ]
        self.merger_norm = require(w, "merger.ln_q.weight")
        self.merger_in = _Linear(w, "merger.mlp.0")
        self.merger_out = _Linear(w, "merger.mlp.2")
        dim = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    @property
    def weight_bytes(self) -> int:
        tensors = [self.patch_embed, self.merger_in.weight, self.merger_out.weight]
        tensors += [lin.weight for b in self.blocks for lin in (b.qkv, b.proj, b.gate, b.up, b.down)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        cfg = self.cfg
        unit = cfg.spatial_merge_size**2
        order, windows, frames, hw = self._layout(grids)
        patch_order = (order[:, None] * unit + torch.arange(unit)).flatten().to(self.device)
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_embed)[patch_order]
        freqs = torch.cat([h[:, None] * self.inv_freq for h in hw], dim=-1)[patch_order.cpu()]
        emb = torch.cat([freqs, freqs], dim=-1).to(self.device)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        for block in self.blocks:
            x = block(x, cos, sin, frames, windows)
        x = rms_norm(x, self.merger_norm, _EPS).view(-1, cfg.hidden_size * unit)
        x = self.merger_out(F.gelu(self.merger_in(x)))
        return x[torch.argsort(order).to(self.device)]

    def _layout(self, grids):
        """Merged-block order (windows of each frame in turn), window and frame lengths in patches, and
        each patch's (row, column) in raster order."""
        cfg = self.cfg
        m, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
        ws = max(cfg.window_size // m // cfg.patch_size, 1)
        order, windows, frames, rows, cols = [], [], [], [], []
        base = 0
        for t, h, w in grids:
            lh, lw = h // m, w // m
            index = torch.arange(t * lh * lw).reshape(t, lh, lw)
            padded = F.pad(index, (0, -lw % ws, 0, -lh % ws), value=-1)
            nh, nw = padded.shape[1] // ws, padded.shape[2] // ws
            win = padded.reshape(t, nh, ws, nw, ws).permute(0, 1, 3, 2, 4).reshape(-1, ws * ws)
            lens = (win >= 0).sum(1)
            order.append(win[win >= 0] + base)
            windows += [int(n) * unit for n in lens if n > 0]
            frames += [h * w] * t
            r = torch.arange(h)[:, None].expand(h, w).reshape(lh, m, lw, m).permute(0, 2, 1, 3).flatten()
            c = torch.arange(w)[None, :].expand(h, w).reshape(lh, m, lw, m).permute(0, 2, 1, 3).flatten()
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
            base += t * lh * lw
        hw = (torch.cat(rows).float(), torch.cat(cols).float())
        return torch.cat(order), windows, frames, hw


def segment_attention(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of the given lengths; segments of equal
    length run as one batch. q, k, v: (N, heads, head_dim)."""
    out = torch.empty_like(q)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    lens = torch.tensor(lengths)
    for n in lens.unique().tolist():
        idx = (starts[lens == n][:, None] + torch.arange(n)).to(q.device)  # (segments, n)
        o = F.scaled_dot_product_attention(*(t[idx].transpose(1, 2) for t in (q, k, v)))
        out[idx] = o.transpose(1, 2)
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _sub(w: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}


class Qwen25VLModel(MropeModel):
    """The Qwen2.5-VL text decoder (qwen2 + M-RoPE) and, when the weights include it, its vision
    encoder as ``vision`` (None for a text-only load)."""

    def __init__(
        self, cfg, tensors: Iterable, dtype, device, weight_format: str = "float", max_positions: int = 8192
    ):
        vision: dict[str, torch.Tensor] = {}
        super().__init__(cfg, split_vision(tensors, vision), dtype, device, weight_format, max_positions)
        self.vision = None
        if vision and cfg.vision is not None:
            self.vision = self.make_encoder(cfg.vision, vision, dtype, device)

    @staticmethod
    def make_encoder(vision_config: dict, tensors: dict, dtype, device):
        return Qwen25VisionEncoder(VisionConfig.from_hf(vision_config), tensors, dtype, device)


def split_vision(tensors: Iterable, vision: dict):
    """The text model's tensors under the decoder's names; the vision tensors go into ``vision``."""
    for name, tensor in tensors:
        if is_vision_tensor(name):
            vision[name.split("visual.", 1)[1]] = tensor
        else:
            yield rename_prefix(name, _TEXT_PREFIXES), tensor
