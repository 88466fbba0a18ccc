"""The llama family: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm), Phi-3/3.5
(fused qkv and gate_up in the checkpoint, longrope, partial rotary). Other families build on it."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from trtedge.runtime.models.config import ModelConfig
from trtedge.runtime.models.layers import (
    GatedMLP,
    fused,
    group_by_layer,
    require,
    rms_norm,
    rotate,
    softcap,
)
from trtedge.runtime.models.native_decode import NativeDecodeStep
from trtedge.runtime.models.rope import partial_rotary_order, permute_heads, rope_tables
from trtedge.runtime.ops import cpu_kernels as kernels
from trtedge.runtime.ops import kv_fp8, triton_attention, triton_gemv
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import DenseLinear, embedding, make_linear
from trtedge.runtime.ops.triton_prefill import paged_prefill_attention


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, index: int, w: dict[str, torch.Tensor], weight_format: str, mlp):
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        attn = "self_attn."
        names = [attn + p + "_proj" for p in "qkv"]
        qkv_w = fused(w, attn + "qkv_proj", names)
        qkv_b = fused(w, attn + "qkv_proj", names, ".bias") if cfg.qkv_bias else None
        self.q_norm = w.get(attn + "q_norm.weight")
        self.k_norm = w.get(attn + "k_norm.weight")
        if cfg.rotary_dim < cfg.head_dim:
            qkv_w, qkv_b = self._permute_for_partial_rotary(qkv_w), self._permute_for_partial_rotary(qkv_b)
        self.qkv = make_linear(qkv_w, qkv_b, weight_format)
        self.o = make_linear(require(w, attn + "o_proj.weight"), w.get(attn + "o_proj.bias"), weight_format)
        self.mlp = mlp
        self.input_norm = require(w, "input_layernorm.weight")
        self.post_norm = require(w, "post_attention_layernorm.weight")
        self.window = cfg.sliding_windows[index]
        self.rope = "local" if self.window and cfg.local_rope is not None else "global"
        backend = (
            CudaAttention if self.input_norm.is_cuda and triton_attention.available() else TorchAttention
        )
        self.attention = backend(cfg.attention_scale, self.window, cfg.attn_logit_softcapping)

    def _permute_for_partial_rotary(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        cfg = self.cfg
        order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
        q, k, v = t.split([self.q_size, self.kv_size, self.kv_size])
        if self.q_norm is not None and self.q_norm.shape[0] == cfg.head_dim and t.dim() == 2:
            self.q_norm, self.k_norm = self.q_norm[order], self.k_norm[order]
        return torch.cat(
            [permute_heads(q, cfg.num_heads, order), permute_heads(k, cfg.num_kv_heads, order), v]
        )

    def attend(self, h, cos, sin, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """Self-attention of the normalised hidden states, through the output projection."""
        cfg = self.cfg
        t = h.shape[0]
        q, k, v = self.qkv(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = self.norm(q, self.q_norm)
            k = self.norm(k, self.k_norm)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = self.attention(q, k, v, k_cache, v_cache, batch)
        return self.o(o.reshape(t, self.q_size))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def __call__(self, x, cos, sin, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.attend(self.norm(x, self.input_norm), cos, sin, k_cache, v_cache, batch)
        return x + self.mlp(self.norm(x, self.post_norm))

    @property
    def linears(self) -> list:
        return [self.qkv, self.o, *self.mlp.linears]


class LlamaModel:
    """A llama-family decoder over a paged KV cache; weights come from HF-named tensors."""

    layer_class = LlamaLayer
    fused_decode = True  # whether decode steps may run the fused kernels (needs the llama layer shape)

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
        # On the CPU the activations (residual stream, norms, attention, KV cache) stay float32 whatever
        # the weights' dtype: bfloat16 weights then cost only the rounding of each product's inputs.
        self.act_dtype = torch.float32 if device.type == "cpu" else dtype
        per_layer, top = group_by_layer(tensors, cfg.num_layers, dtype, device, self.act_dtype)
        self.embed = require(top, "model.embed_tokens.weight")
        self.norm = require(top, "model.norm.weight")
        head = top.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = self.embed
        self.lm_head = make_linear(head, None, weight_format)
        self.layers = []
        for i in range(len(per_layer)):  # each layer's tensors are dropped once built (q/k/v, gate/up
            # are concatenated copies: their mapped pages go with them)
            w, per_layer[i] = per_layer[i], None
            self.layers.append(self.layer_class(cfg, i, w, weight_format, self.make_mlp(i, w, weight_format)))
            del w
        self.rope = {"global": self._tables(cfg.rope, max_positions)}
        if cfg.local_rope is not None:
            self.rope["local"] = self._tables(cfg.local_rope, max_positions)
        # Decode steps run through fused kernels (native C on the CPU in float32, Triton on CUDA): a
        # few calls per layer instead of dozens of small ops, whose dispatch cost dominates decode.
        self.decode_kernels = _decode_kernels(device, dtype) if self.fused_decode else None
        # int4 / int8 weights on the CPU: the whole decode step is one native call.
        self.native_step = NativeDecodeStep.create(self) if self.decode_kernels is not None else None
        # CUDA, bf16/fp16 dense weights, at most 16 rows: the norms, SiLU-mul and residual adds can
        # run inside the products; only with TRTEDGE_DECODE_FUSION=1 for this family (on the H200
        # the fused products are slower per launch than the kernels they replace, so far).
        # TRTEDGE_DECODE_EPILOGUES=1: in the unfused decode layer, the qkv product's epilogue norms,
        # rotates and stores q, k, v (and the MLP's gate_up applies SiLU-mul) where each times faster
        # at start than the product and the separate kernel (opt-in until the step measures faster)
        self.decode_epilogues = (
            device.type == "cuda" and os.environ.get("TRTEDGE_DECODE_EPILOGUES", "0") == "1"
        )
        self.fused_products = (
            self.decode_kernels is not None
            and device.type == "cuda"
            and os.environ.get("TRTEDGE_DECODE_FUSION", "auto") == "1"
            and all(self._layer_fuses(layer) for layer in self.layers)
        )
        # Layers whose input hidden states a draft head reads (EAGLE-3); the last forward's are kept
        # in aux_hidden, concatenated along the feature dimension (index num_layers: the final state).
        self._plain_layers: bool | None = None  # see _prefill_fuses
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def _tables(self, rope, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(rope, self.cfg.head_dim, self.cfg.rotary_dim, max_positions)
        return cos.to(self.device, self.act_dtype), sin.to(self.device, self.act_dtype)

    def make_mlp(self, index: int, w: dict[str, torch.Tensor], weight_format: str):
        return GatedMLP.from_layer(w, self.cfg.hidden_act, weight_format)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding(input_ids, self.embed)

    def rope_for(self, positions: torch.Tensor) -> dict:
        """cos and sin of each rope kind at ``positions``, shaped to broadcast over heads."""
        return {
            k: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
            for k, (cos, sin) in self.rope.items()
        }

    def forward(self, input_ids, positions, kv_caches, batch: AttentionBatch, embeds=None) -> torch.Tensor:
        """``embeds``: (rows, values) that replace the token embeddings of those rows (media tokens);
        values wider than hidden_size carry DeepStack features, added after the first layers."""
        plain_decode = batch.is_decode and embeds is None
        if self.native_step is not None and plain_decode and not self.aux_layers:
            return self.native_step(input_ids, positions, kv_caches, batch)
        if self.decode_kernels is not None and plain_decode:
            return self._decode_fused(input_ids, positions, kv_caches, batch)
        if self._prefill_fuses(batch, positions, embeds):
            return self._prefill_fused(input_ids, positions, kv_caches, batch)
        x = self.embed_tokens(input_ids).to(self.act_dtype)
        width = x.shape[-1]
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1][:, :width].to(x.dtype))
        rope = self.rope_for(positions)
        aux = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_layers:
                aux[i] = x
            x = layer(x, *rope[layer.rope], k_cache, v_cache, batch)
            if embeds is not None and (i + 2) * width <= embeds[1].shape[1]:
                x = x.index_add(0, embeds[0], embeds[1][:, (i + 1) * width : (i + 2) * width].to(x.dtype))
        if self.aux_layers:
            aux[len(self.layers)] = x
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        return self.layers[0].norm(x, self.norm)

    def _decode_fused(self, input_ids, positions, kv_caches, batch: AttentionBatch) -> torch.Tensor:
        cfg, kernels = self.cfg, self.decode_kernels
        n, eps, device = input_ids.shape[0], cfg.rms_norm_eps, input_ids.device
        x = self.embed_tokens(input_ids).to(self.act_dtype).contiguous()  # the residual stream, in place
        h = torch.empty_like(x)
        q = torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=x.dtype, device=device)
        o = torch.empty_like(q)
        tables = batch.tables_tensor if batch.tables_tensor is not None else batch.padded_block_tables()
        context_lens = batch.context_lens_tensor
        if context_lens is None:
            context_lens = torch.tensor(batch.context_lens, dtype=torch.long, device=device)
        if self.fused_products and n <= triton_gemv.MAX_ROWS:
            return self._decode_fused_products(x, h, q, o, positions, kv_caches, batch, tables, context_lens)
        kernels.add_rms_norm(x, None, self.layers[0].input_norm, h, eps)
        # (an fp8 cache's rows are E4M3 bytes and a scale: the unfused store writes them)
        rope_epilogue = (
            self.decode_epilogues
            and n <= triton_gemv.MAX_ROWS
            and triton_gemv.rope_fits(cfg.head_dim)
            and not kv_fp8.is_fp8(kv_caches[0][0])
        )
        taps = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_layers:
                taps[i] = x.clone()  # the residual stream is updated in place
            cos, sin = self.rope[layer.rope]
            if rope_epilogue and type(layer.qkv) is DenseLinear and layer.qkv.skinny is not None:
                store = triton_gemv.RopeStore(
                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions, cos, sin, layer.q_norm,
                    layer.k_norm, eps, batch.slot_mapping, k_cache, v_cache, q,
                )  # fmt: skip
                layer.qkv.skinny.rope_stored(h, store, kernels.rope_store)
            else:
                qkv = layer.qkv(h)
                kernels.qkv_rope_store(
                    qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions, cos, sin,
                    layer.q_norm, layer.k_norm, eps, batch.slot_mapping, k_cache, v_cache, q,
                )  # fmt: skip
            kernels.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                tables,
                context_lens,
                batch.block_size,
                cfg.attention_scale,
                o,
                layer.window,
            )
            kernels.add_rms_norm(x, layer.o(o.view(n, -1)), layer.post_norm, h, eps)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            kernels.add_rms_norm(x, layer.mlp(h, kernels), following, h, eps)
        self._keep_taps(taps, x)
        return h

    def _prefill_fuses(self, batch: AttentionBatch, positions, embeds) -> bool:
        """Whether a prefill (or mixed) step on CUDA can run the decode step's fused kernels around its
        products: the llama layer as it is (no override of its attention, norms or rope), text only,
        with the varlen attention planned."""
        if self.decode_kernels is None or self.device.type != "cuda" or embeds is not None:
            return False
        if batch.prefill_plan is None or not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            return False
        if self._plain_layers is None:
            cls, head_dim = type(self), self.cfg.head_dim
            self._plain_layers = cls.rope_for is LlamaModel.rope_for and all(
                type(layer).__call__ is LlamaLayer.__call__
                and type(layer).attend is LlamaLayer.attend
                and type(layer).norm is LlamaLayer.norm
                and (layer.q_norm is None or layer.q_norm.numel() == head_dim)
                and type(layer.attention) is CudaAttention
                for layer in self.layers
            )
        return self._plain_layers

    def _prefill_fused(self, input_ids, positions, kv_caches, batch: AttentionBatch) -> torch.Tensor:
        """A prefill step through the decode step's kernels: add + RMSNorm in one kernel, q/k-norm +
        RoPE + the KV store in one, SiLU-mul in one, around the products and the varlen attention
        (instead of ~20 torch elementwise kernels a layer; the roundings are the same)."""
        cfg, kernels = self.cfg, self.decode_kernels
        n, eps = input_ids.shape[0], cfg.rms_norm_eps
        x = self.embed_tokens(input_ids).to(self.act_dtype).contiguous()  # the residual stream, in place
        h = torch.empty_like(x)
        q = torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=x.dtype, device=x.device)
        kernels.add_rms_norm(x, None, self.layers[0].input_norm, h, eps)
        taps = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_layers:
                taps[i] = x.clone()
            cos, sin = self.rope[layer.rope]
            kernels.qkv_rope_store(
                layer.qkv(h), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions, cos, sin,
                layer.q_norm, layer.k_norm, eps, batch.slot_mapping, k_cache, v_cache, q,
            )  # fmt: skip
            o = paged_prefill_attention(
                q, k_cache, v_cache, *batch.prefill_plan, layer.attention.scale, layer.window,
                layer.attention.softcap,
            )  # fmt: skip
            kernels.add_rms_norm(x, layer.o(o.view(n, -1)), layer.post_norm, h, eps)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            kernels.add_rms_norm(x, layer.mlp(h, kernels), following, h, eps)
        self._keep_taps(taps, x)
        return h

    def _keep_taps(self, taps: dict, x: torch.Tensor) -> None:
        """aux_hidden from a fused decode step: ``taps`` the inputs of the tapped layers, ``x`` the final
        (pre-norm) residual stream."""
        if self.aux_layers:
            taps[len(self.layers)] = x
            self.aux_hidden = torch.cat([taps[i] for i in self.aux_layers], dim=-1)

    def _decode_fused_products(self, x, h, q, o, positions, kv_caches, batch, tables, context_lens):
        """Four products a layer and attention: qkv reads RMSNorm(x) and writes q, k, v normed and
        rotated (q to ``q``, k and v to the cache), attention (with its split merge), o adds into
        x, then the MLP's ``fused_decode`` (gate_up reads RMSNorm(x), down reads SiLU(gate) * up
        and adds into x)."""
        cfg, kernels = self.cfg, self.decode_kernels
        n, eps = x.shape[0], cfg.rms_norm_eps
        # (an fp8 cache's rows are E4M3 bytes and a scale: the unfused store writes them)
        rope_in_qkv = triton_gemv.rope_fits(cfg.head_dim) and not kv_fp8.is_fp8(kv_caches[0][0])
        taps = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_layers:
                taps[i] = x.clone()  # the residual stream is updated in place
            cos, sin = self.rope[layer.rope]
            if rope_in_qkv:
                store = triton_gemv.RopeStore(
                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions, cos, sin, layer.q_norm,
                    layer.k_norm, eps, batch.slot_mapping, k_cache, v_cache, q,
                )  # fmt: skip
                layer.qkv.skinny.fused(x, norm=layer.input_norm, eps=eps, rope=store, late_norm=True)
            else:
                qkv = layer.qkv.skinny.fused(x, norm=layer.input_norm, eps=eps, late_norm=True)
                kernels.qkv_rope_store(
                    qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions, cos, sin,
                    layer.q_norm, layer.k_norm, eps, batch.slot_mapping, k_cache, v_cache, q,
                )  # fmt: skip
            kernels.paged_decode_attention(
                q, k_cache, v_cache, tables, context_lens, batch.block_size, cfg.attention_scale, o,
                layer.window,
            )  # fmt: skip
            layer.o.skinny.fused(o.view(n, -1), residual=x)
            layer.mlp.fused_decode(x, layer.post_norm, eps)
        kernels.add_rms_norm(x, None, self.norm, h, eps)
        self._keep_taps(taps, x)
        return h

    def _layer_fuses(self, layer) -> bool:
        """Whether a layer's decode products can take its norms, SiLU-mul and residual adds."""
        dense = all(type(lin) is DenseLinear and lin.skinny is not None for lin in (layer.qkv, layer.o))
        return dense and self._mlp_fuses(layer.mlp)

    def _mlp_fuses(self, mlp) -> bool:
        return type(mlp) is GatedMLP and mlp.fuses_decode

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden).float(), self.cfg.final_logit_softcapping)

    def decode_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``logits`` in the model's dtype where no softcap applies (the decode graphs' output: their
        float32 copy was a pass over [rows, vocab] a step; the sampler converts where it needs to)."""
        if self.cfg.final_logit_softcapping is not None:
            return self.logits(hidden)
        return self.lm_head(hidden)

    @property
    def weight_bytes(self) -> int:
        return sum(m.nbytes for m in [self.lm_head] + [m for layer in self.layers for m in layer.linears])


def _decode_kernels(device: torch.device, dtype: torch.dtype):
    if device.type == "cpu":
        lib = kernels.load()  # activations are float32 on the CPU whatever the weights' dtype
        return kernels.CpuDecodeKernels(lib) if lib is not None else None
    if device.type == "cuda" and triton_attention.available():
        from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

        return TritonDecodeKernels()
    return None
