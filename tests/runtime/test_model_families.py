"""Family-specific behaviour against HF transformers: sliding windows past the window, longrope past
the original context, and the error for an unsupported model_type."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.test_models import prefill_logits
from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.models import SUPPORTED_MODEL_TYPES, UnsupportedModelError, load_model
from trtedge.runtime.models.config import ModelConfig

transformers = pytest.importorskip("transformers")


def compare_prefill(path, num_tokens: int, max_positions: int = 256) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (num_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    model = load_model(
        resolve_checkpoint(str(path)),
        dtype="float32",
        device="cpu",
        weights="float",
        max_positions=max_positions,
    )
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    return (prefill_logits(model, ids) - ref).abs().max().item()


@pytest.mark.parametrize("family", ["phi3", "mixtral", "gemma3"])
def test_prompt_longer_than_the_sliding_window_matches_transformers(family, tmp_path):
    path = make_tiny_checkpoint(tmp_path, family)
    cfg = json.loads((path / "config.json").read_text())
    window = cfg["sliding_window"]
    diff = compare_prefill(path, 3 * window)
    print(f"{family}: {3 * window} tokens, window {window}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-4


def test_longrope_uses_long_factors_past_the_original_context(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "phi3")
    # 300 tokens > original_max_position_embeddings (256): HF rotates with the long factors, as we do
    # when the engine's context (max_positions) goes past the original length.
    assert compare_prefill(path, 300, max_positions=512) < 1e-4


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf({"model_type": "gpt_neox", "hidden_size": 8})
    message = str(e.value)
    assert "'gpt_neox'" in message
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in message
    assert {"phi3", "qwen3_moe", "mixtral", "gemma3_text"} <= set(SUPPORTED_MODEL_TYPES)


def test_int8_weights_quantize_the_experts(tmp_path):
    from trtedge.runtime.models.moe import SparseMoE
    from trtedge.runtime.ops.linear import Int8Linear, int8_available

    if not int8_available():
        pytest.skip("no native int8 kernels on this machine")
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    checkpoint = resolve_checkpoint(str(path))
    ids = list(range(3, 40))
    models = {
        w: load_model(checkpoint, dtype="float32", device="cpu", weights=w, max_positions=256)
        for w in ("float", "int8")
    }
    moe = models["int8"].layers[0].mlp
    assert isinstance(moe, SparseMoE)
    assert all(isinstance(m, Int8Linear) for m in moe.linears)
    assert models["int8"].weight_bytes < models["float"].weight_bytes / 2
    ref, ours = (prefill_logits(models[w], ids) for w in ("float", "int8"))
    assert ((ours - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.parametrize("window,cap", [(5, None), (0, 2.0), (7, 3.0)])
def test_reference_attention_window_and_softcap_match_a_dense_computation(window, cap):
    from trtedge.runtime.ops.attention import TorchAttention

    gen = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(n, 19, 8, generator=gen) for n in (4, 2, 2))  # [heads, tokens, dim]
    for qlen in (19, 1):  # prefill of the whole sequence, then the last token alone
        qs = q[:, -qlen:]
        scores = torch.einsum("hqd,hkd->hqk", qs, k.repeat_interleave(2, 0)) * 0.3
        if cap:
            scores = torch.tanh(scores / cap) * cap
        rows = torch.arange(19 - qlen, 19)[:, None]
        cols = torch.arange(19)[None, :]
        visible = (cols <= rows) & ((cols > rows - window) if window else True)
        expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 0)
        ours = TorchAttention(0.3, window, cap)._attend(
            qs.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 19 - qlen
        )
        assert torch.allclose(ours.transpose(0, 1), expected, atol=1e-5)


@pytest.mark.parametrize("window,cap", [(4, None), (6, 3.0), (0, None)])
def test_reference_attention_under_a_token_tree_mask_keeps_the_sliding_window(window, cap):
    """Tree verification: node i at position prefix + depth sees the prefix and its ancestors, and a
    sliding layer only those within ``window`` positions of it (as a plain step at that position)."""
    from trtedge.runtime.ops.attention import TorchAttention
    from trtedge.runtime.speculative.tree import Draft, span_mask

    draft = Draft([5, 6, 7, 8, 9], [0, 0, 1, 2, 3])  # root -> 1, 2; 1 -> 3 -> 5; 2 -> 4
    prefix, nodes = 12, 6
    gen = torch.Generator().manual_seed(window + 1)
    q = torch.randn(nodes, 4, 8, generator=gen)
    k, v = (torch.randn(prefix + nodes, 2, 8, generator=gen) for _ in range(2))
    mask = span_mask(prefix, draft.ancestor_mask())
    positions = torch.tensor(list(range(prefix)) + [prefix + d for d in draft.depths()])
    qpos = positions[prefix:, None]
    visible = mask & ((positions[None, :] > qpos - window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.3
    if cap:
        scores = torch.tanh(scores / cap) * cap
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1).transpose(
        0, 1
    )
    ours = TorchAttention(0.3, window, cap)._attend(q, k, v, prefix, mask)
    assert torch.allclose(ours, expected.transpose(0, 1), atol=1e-5)
