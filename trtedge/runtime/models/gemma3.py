"""Gemma 3 (text): llama-style attention with q/k RMSNorm, plus

- embeddings scaled by sqrt(hidden_size), RMSNorm weights applied as (1 + w) in float32;
- a norm before and after both attention and the MLP ("sandwich" norms);
- GeGLU MLP (gelu tanh);
- sliding-window layers interleaved with global ones (``layer_types``, or every
  ``sliding_window_pattern``-th layer global), the local layers with their own rope base;
- attention scale query_pre_attn_scalar ** -0.5, optional attention / final logit soft-capping.

Decode steps run the reference path (its norms do not fit the llama-shaped fused kernels): on
the CPU torch ops, on CUDA the Triton attention kernels with window and soft-capping, captured in
CUDA graphs. The KV cache keeps every layer's whole context; windowed layers read only the keys
inside their window.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import rename_prefix, require
from trtedge.runtime.models.llama import LlamaLayer, LlamaModel
from trtedge.runtime.ops.linear import embedding

# A multimodal Gemma 3 checkpoint keeps the text model under another prefix; its vision tower and
# projector are not used.
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.": ""}
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


class Gemma3Layer(LlamaLayer):
    def __init__(self, cfg, index: int, w: dict[str, torch.Tensor], weight_format: str, mlp):
        super().__init__(cfg, index, w, weight_format, mlp)
        self.input_norm = _plus_one(self.input_norm)
        self.post_norm = _plus_one(self.post_norm)  # post_attention_layernorm: after attention
        self.pre_ffn_norm = _plus_one(require(w, "pre_feedforward_layernorm.weight"))
        self.post_ffn_norm = _plus_one(require(w, "post_feedforward_layernorm.weight"))
        self.q_norm = _plus_one(require(w, "self_attn.q_norm.weight"))
        self.k_norm = _plus_one(require(w, "self_attn.k_norm.weight"))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF's rounding: normalise and scale in float32, then cast back.
        return F.rms_norm(x.float(), weight.shape, weight, self.cfg.rms_norm_eps).to(x.dtype)

    def __call__(self, x, cos, sin, k_cache, v_cache, batch) -> torch.Tensor:
        h = self.attend(self.norm(x, self.input_norm), cos, sin, k_cache, v_cache, batch)
        x = x + self.norm(h, self.post_norm)
        h = self.mlp(self.norm(x, self.pre_ffn_norm))
        return x + self.norm(h, self.post_ffn_norm)


class Gemma3Model(LlamaModel):
    layer_class = Gemma3Layer
    fused_decode = False

    def __init__(self, cfg, tensors: Iterable[tuple[str, torch.Tensor]], dtype, device, *args, **kwargs):
        super().__init__(cfg, _text_tensors(tensors), dtype, device, *args, **kwargs)
        self.norm = _plus_one(self.norm)
        # HF multiplies by the scale rounded to the weights' dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding(input_ids, self.embed) * self.embed_scale


def _text_tensors(tensors: Iterable[tuple[str, torch.Tensor]]):
    for name, tensor in tensors:
        if not name.startswith(_VISION_PREFIXES):
            yield rename_prefix(name, _TEXT_PREFIXES), tensor
