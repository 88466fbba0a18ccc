"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) against HF transformers, and the engine's
recurrent state: slots per sequence, batched decode, preemption, cancel, snapshots for reuse."""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import in_threads, wait_until
from tests.tiny import make_tiny_hybrid_checkpoint
from trtedge import LLM, ConfigError, ContextCacheConfig, SamplingParams
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.models.config import ModelConfig, UnsupportedModelError
from trtedge.runtime.ops import gated_delta as gd

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The vision-language checkpoint (text served, vision tower skipped)."""
    return make_tiny_hybrid_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "m", vision=True)


def hybrid_llm(path, **options) -> LLM:
    return LLM(
        str(path), **{"dtype": "float32", "max_kv_cache_capacity": 512, "max_input_len": 256, **options}
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy_choices(hf, ids: list[int], output: list[int]) -> list[int]:
    """HF's greedy pick after the prompt and after each of our tokens, in one forward pass: equal to
    ``output`` exactly when HF's own greedy generation would produce ``output`` (by induction), and
    seconds faster than ``generate`` with the torch fallback of the delta rule."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + output])).logits[0]
    return logits[len(ids) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_greedy_64_tokens_match_transformers(kind, hybrid, tmp_path, caplog):
    vision, moe = kind == "qwen3_5", kind == "qwen3_5_moe_text"
    path = hybrid
    if not vision:
        path = make_tiny_hybrid_checkpoint(tmp_path / "text", vision=False, moe=moe, family=kind)
    cls = transformers.Qwen3_5ForConditionalGeneration if vision else transformers.AutoModelForCausalLM
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    # shorter and longer than the 64-token chunk of the delta rule; the long one also prefills in 3 steps
    prompts = [prompt(24, 1), prompt(150, 2)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with caplog.at_level("INFO", logger="trtedge"), hybrid_llm(path, max_num_batched_tokens=64) as llm:
        got = [llm.generate(ids, params).token_ids for ids in prompts]
    assert all(len(out) == 64 for out in got)
    assert [hf_greedy_choices(hf, ids, out) for ids, out in zip(prompts, got)] == got
    assert ("skipped" in caplog.text and "vision" in caplog.text) == vision


def test_chunked_rule_equals_the_recurrent_rule_with_a_carried_state():
    g = torch.Generator().manual_seed(0)
    t, h, dk, dv = 150, 4, 16, 8
    q = gd.l2_normalize(torch.randn(t, h, dk, generator=g)) * dk**-0.5
    k = gd.l2_normalize(torch.randn(t, h, dk, generator=g))
    v, decay, beta = (
        torch.randn(t, h, dv, generator=g),
        -torch.rand(t, h, generator=g),
        torch.rand(t, h, generator=g),
    )
    state = torch.randn(h, dk, dv, generator=g) * 0.1
    out, final = gd.chunk_gated_delta(q, k, v, decay, beta, state)
    s, steps = state.unsqueeze(0), []
    for i in range(t):
        o, s = gd.recurrent_gated_delta(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], decay[i : i + 1], beta[i : i + 1], s
        )
        steps.append(o[0])
    assert torch.allclose(out, torch.stack(steps), atol=1e-5) and torch.allclose(final, s[0], atol=1e-5)


def test_batched_decode_of_8_hybrid_requests_equals_each_alone(hybrid):
    prompts = [prompt(n, 10 + n) for n in (5, 17, 33, 64, 70, 9, 100, 41)]
    with hybrid_llm(hybrid) as llm:
        alone = [llm.generate(p, GREEDY).token_ids for p in prompts]
    with hybrid_llm(hybrid, enable_in_flight_batching=True, max_batch_size=8) as llm:
        together = in_threads(lambda p: llm.generate(p, GREEDY).token_ids, prompts)
        stats = llm.stats()
    assert together == alone
    assert stats["steps"] < 8 * 16  # decoded together
    assert stats["state_slots_total"] == 8 and stats["state_slots_free"] == 8


def test_preemption_recomputes_and_frees_every_state_slot(hybrid):
    prompts = [prompt(20, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with hybrid_llm(hybrid) as llm:
        expected = [llm.generate(p, params).token_ids for p in prompts]
        config = EngineConfig(
            max_batch_size=4, max_kv_cache_capacity=64, enable_in_flight_batching=True, num_blocks=6
        )
        engine = Engine(llm.model, llm.tokenizer, config)
    try:
        streams = [engine.submit(p, params) for p in prompts]
        outs = [[t for d in s for t in d.token_ids] for s in streams]
        assert engine.stats.preemptions > 0
        assert outs == expected
        assert engine.blocks.state.num_free_slots == 4 and engine.blocks.num_free_blocks == 6
    finally:
        engine.shutdown()


def test_cancel_frees_the_state_slot_at_once(hybrid):
    with hybrid_llm(hybrid, enable_in_flight_batching=True, max_batch_size=2) as llm:
        long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        streams = [llm.generate_stream(prompt(30, i), long) for i in range(3)]  # the third waits for a slot
        next(streams[0]), next(streams[1])
        assert llm.stats()["state_slots_free"] == 0
        streams[0].cancel()
        assert [d.finish_reason for d in streams[2]][-1] == "length"  # got the freed slot
        streams[1].cancel()
        list(streams[1])
        assert wait_until(
            lambda: llm.stats()["state_slots_free"] == 2 and llm.stats()["active_requests"] == 0
        )
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_multi_turn_chat_reuses_a_snapshot_with_unchanged_output(hybrid):
    turn1 = [{"role": "user", "content": " ".join(f"w{i}" for i in prompt(70, 7))}]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reuse = ContextCacheConfig(enabled=True)
    with hybrid_llm(hybrid, context_cache_config=reuse) as warm, hybrid_llm(hybrid) as cold:
        first = warm.chat(turn1, params)
        turn2 = turn1 + [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "w5 w6 w7 w8"},
        ]
        second = warm.chat(turn2, params)
        reference = cold.chat(turn2, params)
        metrics = warm.get_context_cache_metrics()
    assert first.token_ids == cold_first(hybrid, turn1, params)
    assert second.metrics.reused_tokens > 0 and second.metrics.reused_tokens % 16 == 0
    assert second.token_ids == reference.token_ids
    assert reference.metrics.reused_tokens == 0
    assert metrics.recurrent_snapshots >= 1 and metrics.hits == 1


def cold_first(path, messages, params) -> list[int]:
    with hybrid_llm(path) as llm:
        return llm.chat(messages, params).token_ids


def test_snapshot_pool_is_bounded_and_counts_evictions(hybrid):
    with hybrid_llm(hybrid) as llm:
        per_snapshot = llm.engine.runner.states.row_bytes
    reuse = ContextCacheConfig(enabled=True, recurrent_snapshot_pool_bytes=2 * per_snapshot + 1)
    with hybrid_llm(hybrid, context_cache_config=reuse) as llm:
        for i in range(5):  # distinct prompts: one prompt snapshot and one generation snapshot each
            llm.generate(prompt(40, 100 + i), GREEDY)
        metrics = llm.get_context_cache_metrics()
        assert metrics.recurrent_snapshot_capacity == 2
        assert metrics.recurrent_snapshots == 2 and metrics.recurrent_snapshot_evictions == 8
        assert metrics.to_dict()["recurrent_snapshot_pool_bytes"] == 2 * per_snapshot
        last = prompt(40, 104)
        warm = llm.generate(last + [5, 6, 7], GREEDY)  # its prefix's snapshot is still in the pool
        assert warm.metrics.reused_tokens == 32
    with hybrid_llm(hybrid) as llm:
        assert llm.generate(last + [5, 6, 7], GREEDY).token_ids == warm.token_ids
    with pytest.raises(ConfigError, match="--context-cache-recurrent-snapshot-pool-bytes"):
        ContextCacheConfig(recurrent_snapshot_pool_bytes=-1)


def test_checkpoint_stops_before_a_thinking_marker(hybrid):
    with hybrid_llm(hybrid, context_cache_config=ContextCacheConfig(enabled=True)) as llm:
        state = llm.engine.blocks.state
    state.marker_ids = frozenset({9})
    ids = list(range(20, 60)) + [9, 10, 11]
    assert state.checkpoint_limit(ids, reuse=True, cache_generated=True) == 40  # before the marker
    assert state.checkpoint_limit(ids[:40], reuse=True, cache_generated=False) == 40
    assert state.checkpoint_limit(ids[:40], reuse=False, cache_generated=True) == 0


def test_unknown_hybrid_families_are_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="'qwen3_6'.*supported: .*qwen3_5_moe, .*qwen3_next"):
        ModelConfig.from_hf({"model_type": "qwen3_6"})


@pytest.mark.parametrize(
    ("config_class", "expected"),
    [("Qwen3NextConfig", True), ("Qwen3MoeConfig", False), ("Qwen2MoeConfig", False)],
)
def test_a_missing_norm_topk_prob_takes_the_family_default_of_transformers(config_class, expected):
    cfg = getattr(transformers, config_class)(
        num_hidden_layers=4, num_experts=4, num_experts_per_tok=2
    ).to_dict()
    assert cfg.pop("norm_topk_prob") is expected  # what HF runs with when config.json leaves it out
    assert ModelConfig.from_hf(cfg).norm_topk_prob is expected
    assert ModelConfig.from_hf({**cfg, "norm_topk_prob": not expected}).norm_topk_prob is not expected


def test_dummy_weights_load_for_benchmarks(hybrid):
    with hybrid_llm(hybrid, load_format="dummy") as llm:
        assert len(llm.generate([5, 6, 7], GREEDY).token_ids) == 16


def test_n_choices_each_recompute_or_reuse_the_prompt_state(hybrid):
    params = SamplingParams(max_tokens=12, n=3, seed=5, ignore_eos=True)
    ids = prompt(40, 9)
    outs = []
    for reuse in (False, True):
        config = ContextCacheConfig(enabled=reuse)
        with hybrid_llm(
            hybrid, enable_in_flight_batching=True, max_batch_size=2, context_cache_config=config
        ) as llm:
            out = llm.generate(ids, params)
            outs.append([c.token_ids for c in out.outputs])
            assert wait_until(lambda: llm.stats()["state_slots_free"] == 2)
    assert outs[0] == outs[1] and len({tuple(o) for o in outs[0]}) == 3
