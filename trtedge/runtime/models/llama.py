"""The llama family: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from trtedge.runtime.models.config import ModelConfig, RopeConfig
from trtedge.runtime.ops import cpu_kernels as kernels
from trtedge.runtime.ops import triton_attention
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import make_linear

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Same rounding as HF: normalise in float32, cast back, then scale.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], weight_format: str):
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        attn = "self_attn."
        qkv_w = torch.cat([w[attn + p + "_proj.weight"] for p in "qkv"])
        qkv_b = torch.cat([w[attn + p + "_proj.bias"] for p in "qkv"]) if cfg.qkv_bias else None
        self.qkv = make_linear(qkv_w, qkv_b, weight_format)
        self.o = make_linear(w[attn + "o_proj.weight"], w.get(attn + "o_proj.bias"), weight_format)
        gate_up = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])
        gate_up_b = torch.cat([w["mlp.gate_proj.bias"], w["mlp.up_proj.bias"]]) if cfg.mlp_bias else None
        self.gate_up = make_linear(gate_up, gate_up_b, weight_format)
        self.down = make_linear(w["mlp.down_proj.weight"], w.get("mlp.down_proj.bias"), weight_format)
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        self.q_norm = w.get(attn + "q_norm.weight")
        self.k_norm = w.get(attn + "k_norm.weight")
        backend = CudaAttention if qkv_w.is_cuda and triton_attention.available() else TorchAttention
        self.attention = backend(cfg.head_dim**-0.5)

    def __call__(self, x, cos, sin, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        q, k, v = self.qkv(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = self.attention(q, k, v, k_cache, v_cache, batch)
        x = x + self.o(o.reshape(t, self.q_size))
        h = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel:
    """A llama-family decoder over a paged KV cache; weights come from HF-named tensors."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = "float",
        max_positions: int = 8192,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
        top: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            tensor = tensor.to(device=device, dtype=dtype)
            m = _LAYER.fullmatch(name)
            if m:
                index = int(m.group(1))
                if index < cfg.num_layers:
                    per_layer[index][m.group(2)] = tensor
            else:
                top[name] = tensor
        self.embed = _require(top, "model.embed_tokens.weight")
        self.norm = _require(top, "model.norm.weight")
        head = top.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = self.embed
        self.lm_head = make_linear(head, None, weight_format)
        self.layers = [LlamaLayer(cfg, w, weight_format) for w in per_layer]
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        # Decode steps run through fused kernels (native C on the CPU in float32, Triton on CUDA): a
        # few calls per layer instead of dozens of small ops, whose dispatch cost dominates decode.
        self.decode_kernels = _decode_kernels(device, dtype)

    def forward(self, input_ids, positions, kv_caches, batch: AttentionBatch) -> torch.Tensor:
        if self.decode_kernels is not None and batch.is_decode:
            return self._decode_fused(input_ids, positions, kv_caches, batch)
        x = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, batch)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def _decode_fused(self, input_ids, positions, kv_caches, batch: AttentionBatch) -> torch.Tensor:
        cfg, kernels = self.cfg, self.decode_kernels
        n, eps, device = input_ids.shape[0], cfg.rms_norm_eps, input_ids.device
        x = F.embedding(input_ids, self.embed).contiguous()  # the residual stream, updated in place
        h = torch.empty_like(x)
        q = torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=x.dtype, device=device)
        o = torch.empty_like(q)
        act = torch.empty(n, cfg.intermediate_size, dtype=x.dtype, device=device)
        tables = batch.tables_tensor if batch.tables_tensor is not None else batch.padded_block_tables()
        context_lens = batch.context_lens_tensor
        if context_lens is None:
            context_lens = torch.tensor(batch.context_lens, dtype=torch.long, device=device)
        scale = cfg.head_dim**-0.5
        kernels.add_rms_norm(x, None, self.layers[0].input_norm, h, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            qkv = layer.qkv(h)
            kernels.qkv_rope_store(
                qkv,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                positions,
                self.cos,
                self.sin,
                layer.q_norm,
                layer.k_norm,
                eps,
                batch.slot_mapping,
                k_cache,
                v_cache,
                q,
            )
            kernels.paged_decode_attention(
                q, k_cache, v_cache, tables, context_lens, batch.block_size, scale, o
            )
            kernels.add_rms_norm(x, layer.o(o.view(n, -1)), layer.post_norm, h, eps)
            kernels.silu_mul(layer.gate_up(h), act)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            kernels.add_rms_norm(x, layer.down(act), following, h, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weight_bytes(self) -> int:
        linear = [self.lm_head] + [
            m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        return sum(m.nbytes for m in linear)


def _decode_kernels(device: torch.device, dtype: torch.dtype):
    if device.type == "cpu":
        lib = kernels.load() if dtype == torch.float32 else None
        return kernels.CpuDecodeKernels(lib) if lib is not None else None
    if device.type == "cuda" and triton_attention.available():
        from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

        return TritonDecodeKernels()
    return None


def _require(tensors: dict, name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    return tensors[name]
