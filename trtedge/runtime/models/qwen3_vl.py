"""Qwen3-VL: its vision encoder, and the model that pairs it with the Qwen3 text decoder (M-RoPE with
interleaved sections, DeepStack).

The encoder differs from Qwen2.5-VL's: the patch embedding has a bias and a learned position table
(a square grid, resampled bilinearly to each image's patch grid), blocks use LayerNorm and a GELU
MLP and attend over the whole frame (no windows), and besides the final merger, DeepStack mergers
read the hidden states after some blocks. Their outputs are returned beside the final embeddings
(concatenated along the features); the text model adds each to the hidden states of the media
tokens after the corresponding early decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import ACTIVATIONS, require
from trtedge.runtime.models.qwen2_5_vl import Qwen25VLModel, _Linear, _rotate, _sub, segment_attention

_EPS = 1e-6


@dataclass(frozen=True)
class Qwen3VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...] = ()
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, cfg: dict) -> Qwen3VisionConfig:
        v = cfg.get("vision_config") or {}
        try:
            return cls(
                depth=int(v["depth"]),
                hidden_size=int(v["hidden_size"]),
                intermediate_size=int(v["intermediate_size"]),
                num_heads=int(v["num_heads"]),
                out_hidden_size=int(v["out_hidden_size"]),
                num_position_embeddings=int(v["num_position_embeddings"]),
                deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", ())),
                patch_size=int(v.get("patch_size", 16)),
                spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
                rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            )
        except KeyError as e:
            raise ValueError(f"config.json vision_config: missing required field {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _layer_norm(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    weight = require(w, name + ".weight")
    return F.layer_norm(x, weight.shape, weight, w.get(name + ".bias"), _EPS)


class _Merger:
    """LayerNorm (over each patch, or over the concatenated 2x2 block with ``postshuffle``), then
    linear, GELU, linear."""

    def __init__(self, w: dict, width: int, postshuffle: bool):
        self.w, self.width, self.postshuffle = w, width, postshuffle
        self.fc1, self.fc2 = _Linear(w, "linear_fc1"), _Linear(w, "linear_fc2")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _layer_norm(x.view(-1, self.width) if self.postshuffle else x, self.w, "norm").view(
            -1, self.width
        )
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen3VisionBlock:
    def __init__(self, cfg: Qwen3VisionConfig, w: dict):
        self.cfg, self.w = cfg, w
        self.qkv, self.proj = _Linear(w, "attn.qkv"), _Linear(w, "attn.proj")
        self.fc1, self.fc2 = _Linear(w, "mlp.linear_fc1"), _Linear(w, "mlp.linear_fc2")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x, cos, sin, frames: list[int]) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        h = _layer_norm(x, self.w, "norm1")
        q, k, v = self.qkv(h).view(n, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        o = segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, frames)
        x = x + self.proj(o.reshape(n, -1))
        return x + self.fc2(self.act(self.fc1(_layer_norm(x, self.w, "norm2"))))


class Qwen3VisionEncoder:
    """Patches of a batch of images / videos -> per placeholder token, the final embedding followed by
    the DeepStack features ((1 + len(deepstack_visual_indexes)) x out_hidden_size values)."""

    def __init__(self, cfg: Qwen3VisionConfig, tensors: dict[str, torch.Tensor], dtype, device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        patch = require(w, "patch_embed.proj.weight")
        self.patch_embed = patch.reshape(patch.shape[0], -1)
        self.patch_bias = w.get("patch_embed.proj.bias")
        self.pos_table = require(w, "pos_embed.weight")
        self.side = int(cfg.num_position_embeddings**0.5)
        self.blocks = [Qwen3VisionBlock(cfg, _sub(w, f"blocks.{i}.")) for i in range(cfg.depth)]
        width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.merger = _Merger(_sub(w, "merger."), width, postshuffle=False)
        self.deepstack = {
            layer: _Merger(_sub(w, f"deepstack_merger_list.{j}."), width, postshuffle=True)
            for j, layer in enumerate(cfg.deepstack_visual_indexes)
        }
        dim = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_embed, self.patch_bias)
        rows, cols, pos, frames = [], [], [], []
        m = self.cfg.spatial_merge_size
        table = self.pos_table.T.reshape(1, -1, self.side, self.side).float()
        for t, h, w in grids:
            r = _merge_order(torch.arange(h)[:, None].expand(h, w), m)
            c = _merge_order(torch.arange(w)[None, :].expand(h, w), m)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # (D, h, w)
            pos.append(_merge_order(grid.permute(1, 2, 0), m).repeat(t, 1))
            frames += [h * w] * t
        x = x + torch.cat(pos).to(x.dtype)
        freqs = torch.cat(
            [
                torch.cat(rows).float()[:, None] * self.inv_freq,
                torch.cat(cols).float()[:, None] * self.inv_freq,
            ],
            -1,
        )
        emb = torch.cat([freqs, freqs], dim=-1).to(self.device)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack:
                features.append(self.deepstack[i](x))
        return torch.cat([self.merger(x), *features], dim=-1)


def _merge_order(grid: torch.Tensor, m: int) -> torch.Tensor:
    """(h, w, ...) values in raster order -> (h * w, ...) with each m x m block's values adjacent."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    return grid.reshape(h // m, m, w // m, m, *rest).transpose(1, 2).reshape(h * w, *rest)


class Qwen3VLModel(Qwen25VLModel):
    """The Qwen3-VL text decoder (qwen3 + interleaved M-RoPE + DeepStack) and its vision encoder as
    ``vision`` (None for a text-only load)."""

    @staticmethod
    def make_encoder(vision_config: dict, tensors: dict, dtype, device):
        return Qwen3VisionEncoder(Qwen3VisionConfig.from_hf(vision_config), tensors, dtype, device)
