"""Gemma 4 (text) and what it shares with Gemma 3n (``PleModel``):

- per-layer embeddings (PLE): each layer adds a gated projection of its slice of
  ``(token's PLE row + a projection of the token embedding) / sqrt 2`` (see ``ple.py`` for residency);
- q and k RMSNorm, v RMSNorm without weight, attention scale 1; RMSNorm weights applied as they are;
- KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values, they read those of
  the last earlier layer of their kind (sliding or full), so only the other layers have a KV cache;
- Gemma 4: global (full-attention) layers with their own head size / KV heads (``global_head_dim``),
  keys as values (``attention_k_eq_v``), proportional rope, a learned scalar per layer; the MoE
  models (``enable_moe_block``) add top-k experts beside each layer's dense MLP, routed on the
  residual stream (RMS-normalised, scaled per channel) with a learned scale per expert.

Layers may differ in KV row size: the runner's pool is sized for the widest, and a narrower layer views
each token's row as its own KV heads, each wider than its head size: its queries, keys and values are
zero-padded to that width (the dot products and the kept outputs are unchanged). Every block and slot
then sits where the runner's block copies (token-tree moves, partial-block snapshots) expect it, and
kernels see a plain contiguous [blocks, block, heads, dim].
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from trtedge.runtime.models.config import ModelConfig, RopeConfig
from trtedge.runtime.models.gemma3 import _text_tensors
from trtedge.runtime.models.layers import ACTIVATIONS, GatedMLP, group_by_layer, require, rotate, softcap
from trtedge.runtime.models.moe import SparseMoE
from trtedge.runtime.models.ple import (
    PLE_TENSOR,
    PerLayerEmbeddings,
    PleRuntimeConfig,
    map_ple_file,
    plan_pieces,
    split_batch,
)
from trtedge.runtime.models.rope import rope_tables
from trtedge.runtime.ops import kv_fp8, triton_attention
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import embedding, make_linear

_AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.", "model.embed_vision.")


def gemma_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (weight applied as it is, or none), cast back: HF's rounding."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def kv_sources(text: dict) -> list[int]:
    """Per layer: the layer whose keys and values it attends to (itself unless it shares)."""
    types, shared = text["layer_types"], int(text.get("num_kv_shared_layers") or 0)
    first = len(types) - shared
    if shared and first <= 0:
        raise ValueError("num_kv_shared_layers leaves no layer to compute keys and values")
    sources = list(range(len(types)))
    for i in range(first, len(types)):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            raise ValueError(f"layer {i} shares the KV of a {types[i]} layer, but none computes one")
        sources[i] = producers[-1]
    return sources


class GemmaAttention:
    def __init__(self, cfg: ModelConfig, index: int, w: dict, weight_format: str, shares: bool, k_eq_v: bool):
        text = cfg.text_config
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = text["_layer_shapes"][index]
        self.shares = shares
        self.q = make_linear(require(w, "self_attn.q_proj.weight"), None, weight_format)
        self.o = make_linear(require(w, "self_attn.o_proj.weight"), None, weight_format)
        self.q_norm = require(w, "self_attn.q_norm.weight").float()
        self.kv = self.k_norm = None
        self.k_eq_v = k_eq_v
        if not shares:
            k = require(w, "self_attn.k_proj.weight")
            self.kv = make_linear(
                k if k_eq_v else torch.cat([k, require(w, "self_attn.v_proj.weight")]), None, weight_format
            )
            self.k_norm = require(w, "self_attn.k_norm.weight").float()
        window = cfg.sliding_windows[index]
        backend = CudaAttention if self.q_norm.is_cuda and triton_attention.available() else TorchAttention
        self.attention = backend(1.0, window, None)

    def __call__(self, h, cos, sin, k_cache, v_cache, batch, step_kv: tuple | None):
        """``step_kv``: this step's (keys, values) of the layer shared from; returns (out, own keys, values)."""
        t = h.shape[0]
        q = gemma_norm(self.q(h).view(t, self.num_heads, self.head_dim), self.q_norm, self.eps)
        q = rotate(q, cos, sin)
        if self.shares:
            k, v = step_kv  # the same values are in the cache already: writing them again is harmless
        else:
            kv = self.kv(h)
            kv_size = self.num_kv_heads * self.head_dim
            raw_k, raw_v = (kv, kv) if self.k_eq_v else kv.split([kv_size, kv_size], dim=-1)
            k = gemma_norm(raw_k.view(t, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
            k = rotate(k, cos, sin)
            v = gemma_norm(raw_v.view(t, self.num_kv_heads, self.head_dim), None, self.eps)
        pad = kv_fp8.head_dim(k_cache) - self.head_dim  # a narrower layer's share of the widest KV row
        if pad:
            q, pk, pv = (F.pad(x, (0, pad)) for x in (q, k, v))
            o = self.attention(q, pk, pv, k_cache, v_cache, batch)[..., : self.head_dim]
        else:
            o = self.attention(q, k, v, k_cache, v_cache, batch)
        return self.o(o.reshape(t, -1)), (k, v)

    @property
    def linears(self) -> list:
        return [self.q, self.o] + ([self.kv] if self.kv is not None else [])


class PleLayer:
    """What both families' layers have: attention, the gated MLP, the PLE gate; norms by name."""

    def __init__(self, cfg: ModelConfig, index: int, w: dict, weight_format: str, shares: bool, mlp):
        text = cfg.text_config
        self.eps = cfg.rms_norm_eps
        self.index = index
        self.kind = text["layer_types"][index]
        k_eq_v = bool(text.get("attention_k_eq_v")) and self.kind == "full_attention"
        self.attn = GemmaAttention(cfg, index, w, weight_format, shares, k_eq_v)
        self.mlp = mlp
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.norms = {
            name: require(w, f"{name}.weight").float()
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm")
        }  # fmt: skip
        self.ple_gate = self.ple_proj = self.moe = None
        if "per_layer_input_gate.weight" in w:
            self.ple_gate = make_linear(w["per_layer_input_gate.weight"], None, weight_format)
            self.ple_proj = make_linear(require(w, "per_layer_projection.weight"), None, weight_format)
            self.norms["post_per_layer_input_norm"] = require(w, "post_per_layer_input_norm.weight").float()

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return gemma_norm(x, self.norms[name], self.eps)

    def add_ple(self, x: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        """The PLE residual of ``x`` (not added): gate, times this layer's PLE input, projected, normed."""
        h = self.ple_proj(self.act(self.ple_gate(x)) * ple)
        return self.norm(h, "post_per_layer_input_norm")

    @property
    def linears(self) -> list:
        own = [self.ple_gate, self.ple_proj] if self.ple_gate is not None else []
        return self.attn.linears + self.mlp.linears + own + (self.moe.linears if self.moe is not None else [])


class Gemma4Experts(SparseMoE):
    """Top-k experts routed on the residual: softmax over experts of the RMS-normalised, per-channel
    scaled stream, renormalised over the k chosen, times each chosen expert's learned scale."""

    def __init__(self, cfg, w: dict, weight_format: str):
        super().__init__(cfg, w, weight_format)
        self.eps = cfg.rms_norm_eps
        self.router_scale = require(w, "router.scale").float() * cfg.hidden_size**-0.5
        self.per_expert_scale = require(w, "router.per_expert_scale").float()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = gemma_norm(x, None, self.eps).float() * self.router_scale
        probs = F.linear(h.to(self.router.dtype), self.router).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        return weights.to(x.dtype), ids

    def experts(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The experts of ``h`` (the normed input), routed on ``x`` (the residual stream)."""
        weights, ids = self.route(x)
        if self.grouped_kernel:
            from trtedge.runtime.ops.triton_moe import fused_experts

            return fused_experts(h, self.w_gate_up, self.w_down, weights, ids, ACTIVATIONS[self.act])
        return self.grouped_reference(h, weights, ids)


class Gemma4Layer(PleLayer):
    def __init__(self, cfg, index, w, weight_format, shares, mlp):
        super().__init__(cfg, index, w, weight_format, shares, mlp)
        self.scalar = w.get("layer_scalar")
        if cfg.sparse_layers[index]:
            self.moe = Gemma4Experts(cfg, w, weight_format)
            for name in (
                "post_feedforward_layernorm_1",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            ):
                self.norms[name] = require(w, f"{name}.weight").float()

    def __call__(self, x, cos, sin, k_cache, v_cache, batch, ple, step_kv):
        h, kv = self.attn(self.norm(x, "input_layernorm"), cos, sin, k_cache, v_cache, batch, step_kv)
        x = x + self.norm(h, "post_attention_layernorm")
        h = self.mlp(self.norm(x, "pre_feedforward_layernorm"))
        if self.moe is not None:
            routed = self.moe.experts(x, self.norm(x, "pre_feedforward_layernorm_2"))
            h = self.norm(h, "post_feedforward_layernorm_1") + self.norm(
                routed, "post_feedforward_layernorm_2"
            )
        x = x + self.norm(h, "post_feedforward_layernorm")
        if ple is not None:
            x = x + self.add_ple(x, ple)
        if self.scalar is not None:
            x = x * self.scalar.to(x.dtype)
        return x, kv


class PleModel:
    """A Gemma 3n / Gemma 4 decoder over the paged KV cache (the runner's CausalLM interface)."""

    layer_class = Gemma4Layer
    fused_decode = False

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = "float",
        max_positions: int = 8192,
        ple: PleRuntimeConfig | None = None,
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.act_dtype = torch.float32 if device.type == "cpu" else dtype
        text = cfg.text_config
        self.text = text
        ple_config = ple or PleRuntimeConfig()
        tables: dict[str, torch.Tensor] = {}
        stream = (
            (n, t)
            for n, t in _text_tensors(tensors)
            if not n.startswith(_AUDIO_PREFIXES) and not _pop(tables, n, t)
        )
        per_layer, top = group_by_layer(stream, cfg.num_layers, dtype, device, self.act_dtype)
        self.embed = require(top, "model.embed_tokens.weight")
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device)
        self.norm = require(top, "model.norm.weight").float()
        head = top.get("lm_head.weight")
        self.lm_head = make_linear(
            self.embed if head is None or cfg.tie_word_embeddings else head, None, weight_format
        )
        self.sources = kv_sources(text)
        own = [i for i, s in enumerate(self.sources) if s == i]
        self.num_kv_layers = len(own)  # the runner's KV pool: layers that compute keys and values
        self.cache_index = {layer: own.index(self.sources[layer]) for layer in range(cfg.num_layers)}
        self.ple = None
        self.ple_dim = int(text.get("hidden_size_per_layer_input") or 0)
        if self.ple_dim:
            self.ple_projection = make_linear(
                require(top, "model.per_layer_model_projection.weight"), None, weight_format
            )
            self.ple_norm = require(top, "model.per_layer_projection_norm.weight").float()
            path = ple_config.file_path
            table = map_ple_file(path) if path is not None else require(tables, PLE_TENSOR)
            source = path or "the checkpoint"
            scale = self.ple_dim**0.5
            self.ple = PerLayerEmbeddings(
                table, ple_config, device, dtype, scale, source, mapped=path is not None
            )
            tables.clear()
        self.layers = [
            self.layer_class(
                cfg, i, w, weight_format, self.sources[i] != i, self.make_mlp(i, w, weight_format)
            )
            for i, w in enumerate(per_layer)
        ]
        self.make_top(top, weight_format)
        self.rope = {
            kind: rope_for(cfg, kind, max_positions, device, self.act_dtype)
            for kind in set(text["layer_types"])
        }
        self.aux_layers: tuple[int, ...] = ()
        # Gemma 4's assistant drafter reads the final (normed) hidden states of every forward: aux_hidden
        self.keep_hidden = False
        self.aux_hidden = None

    def make_mlp(self, index: int, w: dict, weight_format: str):
        return GatedMLP.from_layer(w, self.cfg.hidden_act, weight_format)

    def make_top(self, top: dict, weight_format: str) -> None:
        """Family-specific model-level weights (Gemma 3n: the AltUp projections)."""

    @property
    def graph_safe(self) -> bool:
        """False where a step reads its token ids on the host (a cached PLE pool): no CUDA graphs."""
        return self.ple is None or self.ple.capacity is None

    def forward(self, input_ids, positions, kv_caches, batch: AttentionBatch, embeds=None) -> torch.Tensor:
        if embeds is not None:
            raise ValueError(f"{self.cfg.model_type}: image, video and audio input is not supported yet")
        if self.ple is None or self.ple.capacity is None:
            out = self._forward(input_ids, positions, kv_caches, batch, None)
        else:
            host_ids = self.ple.valid_ids(input_ids).tolist()
            pieces = plan_pieces(host_ids, self.ple.capacity)
            if len(pieces) == 1:
                out = self._forward(input_ids, positions, kv_caches, batch, host_ids)
            else:
                self.ple.split_steps += 1
                out = torch.cat(
                    [
                        self._forward(
                            input_ids[a:b], positions[a:b], kv_caches, split_batch(batch, a, b), host_ids[a:b]
                        )
                        for a, b in pieces
                    ]
                )
        if self.keep_hidden:
            self.aux_hidden = out
        return out

    def _forward(self, input_ids, positions, kv_caches, batch, host_ids) -> torch.Tensor:
        x = (embedding(input_ids, self.embed) * self.embed_scale).to(self.act_dtype)
        ple = self._ple_inputs(input_ids, x, host_ids) if self.ple is not None else None
        rope = {
            k: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
            for k, (cos, sin) in self.rope.items()
        }
        x = self.begin(x)
        step_kv: dict[int, tuple] = {}
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = (_view(c, layer.attn) for c in kv_caches[self.cache_index[i]])
            x, kv = layer(
                x, *rope[layer.kind], k_cache, v_cache, batch,
                ple[:, i] if ple is not None else None, step_kv.get(self.sources[i]),
            )  # fmt: skip
            step_kv[i] = kv
        return gemma_norm(self.end(x), self.norm, self.cfg.rms_norm_eps)

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def end(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _ple_inputs(self, input_ids, x, host_ids) -> torch.Tensor:
        """[T, num_layers, ple_dim]: (normed projection of the embeddings + the tokens' PLE rows) / sqrt 2."""
        t, n, p = x.shape[0], self.cfg.num_layers, self.ple_dim
        proj = self.ple_projection(x) * self.cfg.hidden_size**-0.5
        proj = gemma_norm(proj.view(t, n, p), self.ple_norm, self.cfg.rms_norm_eps)
        rows = self.ple.rows(self.ple.valid_ids(input_ids), host_ids).to(x.dtype)
        return (proj + rows.view(t, -1, p)[:, :n]) * 2**-0.5

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden).float(), self.cfg.final_logit_softcapping)

    @property
    def weight_bytes(self) -> int:
        return sum(m.nbytes for m in [self.lm_head] + [m for layer in self.layers for m in layer.linears])


def rope_for(
    cfg: ModelConfig, kind: str, max_positions: int, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) tables of the layers of ``kind`` (sliding or full attention): their head size, the
    local or global rope, partial rotary unless proportional."""
    text = cfg.text_config
    rope: RopeConfig = cfg.local_rope if kind == "sliding_attention" else cfg.rope
    head_dim = next(d for (_, d), t in zip(text["_layer_shapes"], text["layer_types"]) if t == kind)
    rotary = head_dim if rope.kind == "proportional" else int(head_dim * cfg.partial_rotary_factor)
    cos, sin = rope_tables(rope, head_dim, rotary, max_positions)
    return cos.to(device, dtype), sin.to(device, dtype)


def _pop(tables: dict, name: str, tensor) -> bool:
    """Keep the PLE table out of the device upload (its residency decides where it goes)."""
    if name == PLE_TENSOR:
        tables[name] = tensor
        return True
    return False


def _view(cache: torch.Tensor, attn: GemmaAttention) -> torch.Tensor:
    """A layer's [blocks, block, heads, dim] cache as [blocks, block, its KV heads, row / its KV heads]."""
    blocks, size, heads, dim = cache.shape
    if heads == attn.num_kv_heads:
        return cache
    return cache.view(blocks, size, attn.num_kv_heads, heads * dim // attn.num_kv_heads)


class Gemma4Model(PleModel):
    layer_class = Gemma4Layer
