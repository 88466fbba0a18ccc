"""MTP speculative decoding on CUDA (Qwen3.5, Qwen3.5-MoE, Nemotron-H with their own mtp.* layers): greedy output
equals plain decoding in float32 alone and in a batch of 8, every KV block, state slot and draft row
is freed, the head's draft logits equal the CPU torch reference, and the hidden states plain steps
replayed as CUDA graphs hand the MTP layer are those eager steps hand it. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.mtp_tiny import Reference, add_mtp_layers, add_nemotron_mtp_layers
from tests.runtime.spec_helpers import host_drafts, repetitive_prompts
from tests.tiny import make_tiny_hybrid_checkpoint, make_tiny_nemotron_h_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.speculative.draft_cache import DraftCache, DraftState, Row

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _llm(path, batch: int, spec=None, eager: bool = False) -> LLM:
    return LLM(
        str(path),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_batch_size=batch,
        enable_in_flight_batching=batch > 1,
        engine_process=False,  # the test reads the engine's pools
        enforce_eager=eager,
        speculative_config=spec,
    )


def _checkpoint(tmp_path, family: str):
    if family == "nemotron_h":
        path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
        add_nemotron_mtp_layers(path)
    else:
        path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False, moe=family == "qwen3_5_moe")
        add_mtp_layers(path, moe=family == "qwen3_5_moe")
    return path


def _outputs(path, batch: int, spec=None) -> list[list[int]]:
    with _llm(path, batch, spec) as llm:
        outs = [o.token_ids for o in llm.generate(repetitive_prompts(8, seed=11), GREEDY)]
        engine = llm.engine
        if spec is not None:
            assert llm.speculative_metrics()["steps"] > 0
            cache = engine.speculative.proposer.cache
            assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots
        return outs


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "nemotron_h"])
def test_mtp_greedy_on_cuda_matches_plain_alone_and_in_a_batch_of_8(tmp_path, family):
    path = _checkpoint(tmp_path, family)
    plain = _outputs(path, 8)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    assert _outputs(path, 8, spec) == plain
    assert _outputs(path, 1, spec) == plain


def _drafts_sitting_out(path, eager: bool) -> tuple[list[list[int]], list]:
    """Greedy outputs of a batch of 8 and the MTP drafts, the proposer sitting out two steps of three
    (its rows then decode plainly: through the CUDA graphs unless ``eager``; the MTP layer catches up
    over those positions' hidden states at its next turn)."""
    with _llm(path, 8, {"method": "mtp", "num_speculative_tokens": 3}, eager) as llm:
        engine = llm.engine
        if not eager and engine.runner.graphs is None:
            pytest.skip("this model's decode steps do not run as CUDA graphs yet")
        proposer = engine.speculative.proposer
        propose, calls, drafts = proposer.propose, [0], []

        def two_of_three_off(seqs, limits):
            calls[0] += 1
            if calls[0] % 3:
                return [None] * len(seqs)
            out = propose(seqs, limits)
            drafts.append(
                [(seq.num_tokens, d.tokens if d else None) for seq, d in zip(seqs, host_drafts(out))]
            )
            return out

        proposer.propose = two_of_three_off
        outs = [o.token_ids for o in llm.generate(repetitive_prompts(8, seed=11), GREEDY)]
        cache = proposer.cache
        assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots
    return outs, drafts


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_mtp_reads_the_same_hidden_states_from_graph_steps_as_from_eager_ones(tmp_path, family):
    path = _checkpoint(tmp_path, family)
    plain = _outputs(path, 8)
    eager_outs, eager_drafts = _drafts_sitting_out(path, eager=True)
    graph_outs, graph_drafts = _drafts_sitting_out(path, eager=False)
    assert eager_outs == plain and graph_outs == plain
    assert any(d for step in eager_drafts for _, d in step)
    assert graph_drafts == eager_drafts


def test_mtp_head_logits_on_cuda_match_the_reference(tmp_path):
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    from trtedge.runtime.speculative.mtp import load_mtp

    path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False)
    tensors = add_mtp_layers(path)
    reference = Reference(path, tensors)
    checkpoint = resolve_checkpoint(str(path))
    model = load_model(checkpoint, dtype="float32", device="cuda", weights="auto", max_positions=256)
    head = load_mtp(checkpoint, model)
    prompt = repetitive_prompts(1, seed=4)[0]
    cfg = model.cfg
    # the head's input rows: seeded random states, not transformers' target forward, whose Qwen3.5
    # linear-attention layers call fla-core's Triton kernels wherever it is installed (CPU tensors fail)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(len(prompt) - 1, cfg.hidden_size, generator=generator)
    cache = DraftCache(1, cfg.num_kv_heads, cfg.head_dim, 8, 16, torch.float32, model.device)
    st = DraftState()
    cache.reserve(st, len(prompt))
    ids, positions, attn = cache.attention_batch([Row(st, prompt[1:], list(range(len(prompt) - 1)), 0)])
    logits, _ = head.forward(ids, hidden.cuda(), positions, cache.kv_caches, attn)
    expected, _ = reference.rows(hidden, prompt[1:], list(range(len(prompt) - 1)))
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-4, atol=1e-4)
