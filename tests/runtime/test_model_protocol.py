"""Every model family the engine runs is a CausalLM (hybrids a HybridCausalLM): what the runner, the
CUDA graphs and the speculative decoders call exists, and model_traits reads the optional parts."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint, make_tiny_ple_checkpoint
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.models import load_model
from trtedge.runtime.models.protocol import CausalLM, HybridCausalLM, model_traits

MAKERS = {
    "llama": lambda d: make_tiny_checkpoint(d, "llama"),
    "qwen3_5_text": lambda d: make_tiny_hybrid_checkpoint(d, vision=False),
    "gemma4": lambda d: make_tiny_ple_checkpoint(d, "gemma4"),
}


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_a_loaded_model_is_a_causal_lm(family, tmp_path):
    path = MAKERS[family](tmp_path)
    model = load_model(
        resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights="float", max_positions=64
    )
    assert isinstance(model, CausalLM)
    traits = model_traits(model)
    assert isinstance(model, HybridCausalLM) == traits.hybrid == (family == "qwen3_5_text")
    assert traits.act_dtype == torch.float32 and traits.tp is None and traits.vision is None
    assert 0 < traits.num_kv_layers <= model.cfg.num_layers
    if traits.hybrid:
        assert traits.num_kv_layers < model.cfg.num_layers  # its linear-attention layers keep none
    assert (traits.ple is not None) == (family == "gemma4")


def test_the_check_sees_a_model_without_logits():
    class Half:
        cfg, device, dtype, aux_layers, weight_bytes = None, None, None, (), 0

        def forward(self, *args, **kwargs): ...

    assert not isinstance(Half(), CausalLM)
