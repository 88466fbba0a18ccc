"""The CPU decode step of a llama-family model with int4 / int8 weights as one native call
(``ops/cpu_step.py``): the plan that describes the model to it, and when it applies."""

from __future__ import annotations

import torch

from trtedge.runtime.models.layers import GatedMLP
from trtedge.runtime.ops import cpu_kernels, cpu_step
from trtedge.runtime.ops.attention import AttentionBatch
from trtedge.runtime.ops.linear import GgufLinear, Int4Linear, Int8Linear


def _linear_words(layer) -> list[int]:
    bias = 0 if layer.bias is None else layer.bias.data_ptr()
    if isinstance(layer, Int4Linear):
        q = layer.quantized
        return [4, q.data.data_ptr(), q.scale.data_ptr(), q.min.data_ptr(), bias, *q.shape]
    if isinstance(layer, GgufLinear):  # the min word: the number of row segments
        q = layer.quantized
        return [cpu_step.GGUF_FORMAT, q.data.data_ptr(), q.scale.data_ptr(), q.scale.shape[0], bias, *q.shape]
    return [8, layer.qweight.data_ptr(), layer.scale.data_ptr(), 0, bias, *layer.quantized.shape]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def supported(model) -> bool:
    """Whether every layer has the shape the native step computes: full-rotary attention without
    logit softcapping, a SiLU-gated MLP, all products int4 / int8, float32 on the CPU."""
    cfg = model.cfg
    if model.device.type != "cpu" or model.dtype != torch.float32 or not model.layers:
        return False
    if cfg.rotary_dim != cfg.head_dim or cfg.attn_logit_softcapping or cfg.num_heads % cfg.num_kv_heads:
        return False
    for layer in model.layers:
        if not isinstance(layer.mlp, GatedMLP) or layer.mlp.act != "silu":
            return False
        if not all(
            isinstance(m, (Int4Linear, Int8Linear, GgufLinear)) and m.lib is not None for m in layer.linears
        ):
            return False
        norms = [n for n in (layer.q_norm, layer.k_norm) if n is not None]
        if any(n.shape != (cfg.head_dim,) for n in norms):
            return False
    return True


class NativeDecodeStep:
    """Runs decode steps through ``llama_decode_step``; the plan is rebuilt when the KV cache the
    step writes into changes (a new runner)."""

    def __init__(self, model, lib):
        self.model = model
        self.fn = lib.llama_decode_step
        self.plan: torch.Tensor | None = None
        self.cache_ptr = None
        for layer in model.layers:  # the plan points into these: keep them float32 and contiguous
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, t.float().contiguous())
        model.norm = model.norm.float().contiguous()

    @classmethod
    def create(cls, model) -> NativeDecodeStep | None:
        lib = cpu_kernels.load()
        if lib is None or not supported(model):
            return None
        return cls(model, lib)

    def _plan(self, kv_caches) -> torch.Tensor:
        m, cfg = self.model, self.model.cfg
        words = [cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size]
        words += [m.layers[0].mlp.gate_up.quantized.shape[0] // 2, m.norm.data_ptr(), cpu_step.SPIN_NS]
        words += [cpu_kernels.kv_kind(kv_caches[0][0])]
        for layer, (k_cache, v_cache) in zip(m.layers, kv_caches):
            mlp = layer.mlp
            for linear in (layer.qkv, layer.o, mlp.gate_up, mlp.down):
                words += _linear_words(linear)
            cos, sin = m.rope[layer.rope]
            words += [layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
            words += [_ptr(layer.q_norm), _ptr(layer.k_norm), k_cache.data_ptr(), v_cache.data_ptr()]
            words += [cos.data_ptr(), sin.data_ptr(), layer.window or 0]
        assert len(words) == cpu_step.PLAN_HEADER + cfg.num_layers * cpu_step.LAYER_WORDS
        return torch.tensor(words, dtype=torch.int64)

    def __call__(self, input_ids, positions, kv_caches, batch: AttentionBatch) -> torch.Tensor:
        # a new pool may take a freed one's address (and differ in dtype)
        cache = (kv_caches[0][0].data_ptr(), kv_caches[0][0].dtype)
        if self.cache_ptr != cache:
            self.plan, self.cache_ptr = self._plan(kv_caches), cache
        m, cfg = self.model, self.model.cfg
        n = input_ids.shape[0]
        x = m.embed_tokens(input_ids).contiguous()
        out = torch.empty_like(x)
        if n == 1:
            tables = batch.block_tables[0]
            context_lens = torch.tensor(batch.context_lens, dtype=torch.long)
        else:
            tables = batch.tables_tensor if batch.tables_tensor is not None else batch.padded_block_tables()
            context_lens = batch.context_lens_tensor
            if context_lens is None:
                context_lens = torch.tensor(batch.context_lens, dtype=torch.long)
        tables = tables.contiguous()
        slots, positions = batch.slot_mapping.contiguous(), positions.contiguous()
        self.fn(
            self.plan.data_ptr(), x.data_ptr(), n, positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[-1] if n > 1 else tables.numel(), context_lens.data_ptr(),
            batch.block_size, cfg.rms_norm_eps, cfg.attention_scale, out.data_ptr(),
        )  # fmt: skip
        return out
