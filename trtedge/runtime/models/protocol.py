"""The model interface the engine relies on: the runner, its CUDA graphs, the speculative decoders and
the engine's views call these and nothing else of a model. ``CausalLM`` is what every family
provides; ``HybridCausalLM`` adds the recurrent state of hybrid families (Qwen3.5, Nemotron-H);
``model_traits`` reads the parts only some families have, each with its default, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from trtedge.runtime.models.config import ModelConfig
from trtedge.runtime.ops.attention import AttentionBatch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer with a KV cache: (keys, values)


@runtime_checkable
class CausalLM(Protocol):
    """A decoder the engine runs: ``forward`` the step's tokens (ids and positions, the KV caches, the
    attention batch; ``embeds`` of media rows, ``states`` of a hybrid) to hidden states, ``logits`` of
    some of them (float32)."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype  # the weights'
    aux_layers: tuple[int, ...]  # layers whose input an EAGLE-3 head reads; () for none

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        batch: AttentionBatch,
        **extra,
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @property
    def weight_bytes(self) -> int: ...


@runtime_checkable
class HybridCausalLM(CausalLM, Protocol):
    """A decoder with recurrent layers too (``forward`` takes their ``states``): the shapes of a state
    row (``state_spec``); only its full-attention layers keep a KV cache (``num_kv_layers``)."""

    def state_spec(self) -> dict: ...


@dataclass(frozen=True)
class ModelTraits:
    """What only some families have, with each one's default."""

    num_kv_layers: int  # layers with a KV cache: not a hybrid's recurrent ones, nor Gemma's KV-sharing ones
    act_dtype: torch.dtype  # activations and KV cache (float32 on the CPU whatever the weights')
    graph_safe: bool  # a step can be captured in a CUDA graph (a cached PLE pool reads ids on the host)
    hybrid: bool  # recurrent layers: a HybridCausalLM
    vision: Any = None  # the vision encoder, when loaded
    audio: Any = None  # the audio encoder, when loaded
    tp: Any = None  # tensor parallel: the other ranks (rank 0's model)
    ple: Any = None  # Gemma 3n / Gemma 4: the per-layer embedding table or pool


def model_traits(model: CausalLM) -> ModelTraits:
    """The optional parts of ``model`` (the one place that looks for them)."""
    hybrid = isinstance(model, HybridCausalLM)
    return ModelTraits(
        num_kv_layers=getattr(model, "num_kv_layers", model.cfg.num_layers),
        act_dtype=getattr(model, "act_dtype", model.dtype),
        graph_safe=bool(getattr(model, "graph_safe", True)),
        hybrid=hybrid,
        vision=getattr(model, "vision", None),
        audio=getattr(model, "audio", None),
        tp=getattr(model, "tp", None),
        ple=getattr(model, "ple", None),
    )
