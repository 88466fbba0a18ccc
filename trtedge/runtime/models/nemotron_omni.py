"""Nemotron Omni's video path (``nemotron_h_omni``): the RADIO vision tower over tubelets, pixel shuffle
and the projector into the Nemotron-H decoder.

A tubelet is ``video_temporal_patch_size`` consecutive frames stacked on the channel axis; its
patches go through the tower's video patch projection, get the tower's position table interpolated to
the frame's patch grid, and follow the cls / register tokens through pre-norm ViT blocks. The patch
features (optionally layer-normed) are pixel-shuffled 2x2 -> 1 and projected (RMSNorm, linear,
squared ReLU, linear): a tubelet of h x w patches is h * w / 4 placeholder tokens. Tubelets are
encoded independently, so a video's tubelets may be split across prompt segments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VISION_PREFIXES = (
    "vision_model.",
    "multi_modal_projector.",
    "vision_final_layernorm.",
    "mlp1.",
    "vision_projector.",
)
# Nemotron Omni's audio branch and the tower's own pixel normaliser (the processor normalises)
UNUSED_PREFIXES = ("audio_tower.", "embed_audio.", "sound_encoder.", "sound_projection.")
_UNUSED_VISION = ("vision_model.input_conditioner.", "vision_model.summary_idxs")


# The released checkpoints' names (also what transformers saves) -> transformers' module names.
_RENAMES = (
    (
        "vision_model.radio_model.model.patch_generator.video_embedder.",
        "vision_model.embeddings.video_patch_projection.",
    ),
    ("vision_model.radio_model.model.patch_generator.embedder.", "vision_model.embeddings.patch_projection."),
    (
        "vision_model.radio_model.model.patch_generator.pos_embed",
        "vision_model.embeddings.position_embedding",
    ),
    (
        "vision_model.radio_model.model.patch_generator.cls_token.token",
        "vision_model.embeddings.cls_register_token",
    ),
    ("vision_model.radio_model.model.blocks.", "vision_model.encoder.layer."),
    ("vision_model.radio_model.", "vision_model."),
    ("mlp1.0.", "multi_modal_projector.layer_norm."),
    ("mlp1.1.", "multi_modal_projector.linear_1."),
    ("mlp1.3.", "multi_modal_projector.linear_2."),
    ("vision_projector.vision_final_layernorm.", "vision_final_layernorm."),
)


def is_omni_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def omni_vision_name(name: str) -> str:
    """A vision tensor's name as transformers' modules have it (fused ``attn.qkv`` -> ``attention.qkv``)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    return name.replace(".attn.proj.", ".attention.o_proj.").replace(".attn.qkv.", ".attention.qkv.")


class RadioVideoEncoder:
    """``__call__(patches, grids)``: (sum of t * h * w, temporal * channels * patch**2) flattened tubelet
    patches and each video's (t, h, w) patch grid -> (sum of t * h * w / 4, text hidden) embeddings."""

    def __init__(self, vision: dict, tensors: dict[str, torch.Tensor], dtype, device):
        cfg = vision.get("vision_config") or {}
        self.heads = int(cfg.get("num_attention_heads", 16))
        self.eps = float(cfg.get("layer_norm_eps", 1e-6))
        self.patch = int(cfg.get("patch_size", 16))
        max_side = int(cfg.get("max_img_size", 2048)) // self.patch
        self.max_grid = (max_side, max_side)
        self.num_prefix = int(cfg.get("num_cls_tokens", 3)) + int(cfg.get("num_registers", 7))
        act = str(cfg.get("hidden_act", "gelu"))
        if act not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"config.json: vision_config.hidden_act {act!r} is not supported")
        self.gelu = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.swiglu = bool(cfg.get("use_swiglu_ffn", False))
        self.scale = 1.0 / float(vision.get("downsample_ratio", 0.5))
        if self.scale != 2.0:
            raise ValueError("config.json: downsample_ratio must be 0.5 (a 2x2 pixel shuffle)")
        self.device, self.dtype = torch.device(device), dtype
        w = {
            k: v.to(device=self.device, dtype=dtype)
            for k, v in tensors.items()
            if not k.startswith(_UNUSED_VISION)
        }
        self.w = w
        self.num_layers = int(cfg.get("num_hidden_layers", 0)) or len(
            {k.split(".")[3] for k in w if k.startswith("vision_model.encoder.layer.")}
        )
        if "vision_model.embeddings.video_patch_projection.weight" not in w:
            raise ValueError(
                "the checkpoint's vision tower has no video patch projection (video_temporal_patch_size)"
            )

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    @torch.inference_mode()
    def __call__(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        out, start = [], 0
        for t, h, wd in grids:
            n = t * h * wd
            out.append(self._video(patches[start : start + n].to(self.device, self.dtype), t, h, wd))
            start += n
        return torch.cat(out)

    def _video(self, patches: torch.Tensor, t: int, h: int, wd: int) -> torch.Tensor:
        w = self.w
        x = F.linear(patches, w["vision_model.embeddings.video_patch_projection.weight"]).view(t, h * wd, -1)
        x = x + self._positions(h, wd).to(x.dtype)
        prefix = w["vision_model.embeddings.cls_register_token"]
        x = torch.cat([prefix.expand(t, -1, -1), x], 1)
        for i in range(self.num_layers):
            x = self._layer(x, f"vision_model.encoder.layer.{i}.")
        x = x[:, self.num_prefix :]
        if "vision_final_layernorm.weight" in w:
            x = F.layer_norm(
                x,
                x.shape[-1:],
                w["vision_final_layernorm.weight"],
                w["vision_final_layernorm.bias"],
                self.eps,
            )
        x = _pixel_shuffle(x.reshape(t, h, wd, -1)).reshape(t * (h // 2) * (wd // 2), -1)
        return self._project(x)

    def _positions(self, h: int, wd: int) -> torch.Tensor:
        table = self.w["vision_model.embeddings.position_embedding"]
        rows, cols = self.max_grid
        pos = table.reshape(1, rows, cols, -1).permute(0, 3, 1, 2).float()
        side = max(h, wd)
        pos = F.interpolate(pos, size=(side, side), mode="bilinear", align_corners=False)[..., :h, :wd]
        return pos.flatten(2).permute(0, 2, 1)[0]

    def _layer(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        y = F.layer_norm(x, x.shape[-1:], w[p + "norm1.weight"], w[p + "norm1.bias"], self.eps)
        x = x + _scaled(self._attention(y, p + "attention."), w.get(p + "layer_scale1.lambda1"))
        y = F.layer_norm(x, x.shape[-1:], w[p + "norm2.weight"], w[p + "norm2.bias"], self.eps)
        return x + _scaled(self._mlp(y, p + "mlp."), w.get(p + "layer_scale2.lambda1"))

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        b, n, _ = x.shape
        if p + "qkv.weight" in w:  # the released layout: one fused projection
            qkv = F.linear(x, w[p + "qkv.weight"], w.get(p + "qkv.bias")).chunk(3, -1)
        else:
            qkv = [F.linear(x, w[f"{p}{c}_proj.weight"], w.get(f"{p}{c}_proj.bias")) for c in "qkv"]
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in qkv)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        return F.linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        if self.swiglu:
            gate = F.linear(x, w[p + "gate_proj.weight"], w[p + "gate_proj.bias"])
            up = F.linear(x, w[p + "up_proj.weight"], w[p + "up_proj.bias"])
            return F.linear(F.silu(gate) * up, w[p + "down_proj.weight"], w[p + "down_proj.bias"])
        y = F.gelu(F.linear(x, w[p + "fc1.weight"], w[p + "fc1.bias"]), approximate=self.gelu)
        return F.linear(y, w[p + "fc2.weight"], w[p + "fc2.bias"])

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, "multi_modal_projector."
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w[p + "layer_norm.weight"].float()
        h = F.linear(h.to(x.dtype), w[p + "linear_1.weight"], w.get(p + "linear_1.bias"))
        h = F.relu(h).square()
        return F.linear(h, w[p + "linear_2.weight"], w.get(p + "linear_2.bias"))


def _scaled(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x if scale is None else x * scale  # C-RADIO has no layer scale (checkpoints may omit it)


def _pixel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """(n, h, w, c) -> (n, h / 2, w / 2, 4c), in the checkpoint's channel order."""
    n, h, w, c = x.shape
    x = x.reshape(n, h, w // 2, c * 2).transpose(1, 2)
    return x.reshape(n, w // 2, h // 2, c * 4).transpose(1, 2)
