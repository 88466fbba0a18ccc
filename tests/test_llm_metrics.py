"""What LLM's getters return: context-cache metrics as a frozen dataclass with attributes (as the
docs' example reads them) that also converts to a dict."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, ContextCacheConfig, ContextCacheMetrics, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "qwen2")


def test_context_cache_metrics_are_attributes_of_a_frozen_dataclass(tiny_path):
    reuse = ContextCacheConfig(enabled=True)
    with LLM(str(tiny_path), max_kv_cache_capacity=256, max_input_len=128, context_cache_config=reuse) as llm:
        prompt = list(range(5, 45))  # two full blocks and 8 tokens
        llm.generate(prompt, GREEDY)
        warm = llm.generate(prompt + [7, 8], GREEDY)
        metrics = llm.get_context_cache_metrics()
    assert isinstance(metrics, ContextCacheMetrics)
    assert metrics.reused_tokens == warm.metrics.reused_tokens == 32
    assert (metrics.lookups, metrics.hits) == (2, 1) and metrics.records >= 2
    assert metrics.recurrent_snapshots is None  # not a hybrid model
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics.hits = 0  # type: ignore[misc]
    as_dict = metrics.to_dict()
    assert as_dict == {
        "lookups": 2,
        "hits": 1,
        "reused_tokens": 32,
        "records": metrics.records,
        "evictions": metrics.evictions,
    }


def prompt(n: int, start: int = 5) -> list[int]:
    return [start + i % 400 for i in range(n)]


def test_profiling_aggregates_runs_and_is_independent_of_on_metrics(tiny_path):
    with LLM(str(tiny_path), max_kv_cache_capacity=256, max_input_len=128) as llm:
        assert not llm.get_profiling_enabled()
        llm.generate(prompt(20), GREEDY)
        off = llm.get_profiling_metrics()
        assert not off.enabled and off.generation.generated_tokens == 0 and off.stages == {}
        llm.set_profiling_enabled(True)
        seen = []
        a = llm.generate(prompt(20), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        b = llm.generate(
            prompt(24, 50),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            on_metrics=seen.append,
        )
        on = llm.get_profiling_metrics()
        assert on.enabled and on.timer == "wall_clock"
        assert (
            on.prefill.total_runs == 2 and on.prefill.computed_tokens == 44 and on.prefill.reused_tokens == 0
        )
        assert on.generation.generated_tokens == len(a.token_ids) + len(b.token_ids) == 8
        assert on.generation.total_runs == 4 + 2  # every output token after the first is a decode step
        assert on.stages["llm_prefill"].runs == 2 and on.stages["llm_generation"].runs == 6
        assert on.stages["schedule"].runs >= 8
        assert on.prefill.total_time == on.stages["llm_prefill"].total_time > 0
        assert on.generation.total_time == on.stages["llm_generation"].total_time > 0
        assert seen[0] == b.metrics and seen[0].generated_tokens == 3  # the per-request figures are their own
        llm.set_profiling_enabled(False)
        llm.generate(prompt(20), GREEDY)
        assert llm.get_profiling_metrics().generation == on.generation  # off: nothing more is added
        assert llm.get_profiling_metrics().to_dict()["prefill"]["computed_tokens"] == 44
        llm.reset_profiling_metrics()
        assert llm.get_profiling_metrics().prefill.total_runs == 0
        with pytest.raises(TypeError, match="true or false"):
            llm.set_profiling_enabled("yes")  # type: ignore[arg-type]


def test_profiling_counts_reused_prompt_tokens_and_shows_in_prometheus(tiny_path):
    import asyncio

    import httpx

    from trtedge.server.app import build_app

    reuse = ContextCacheConfig(enabled=True)
    with LLM(str(tiny_path), max_kv_cache_capacity=256, max_input_len=128, context_cache_config=reuse) as llm:
        llm.set_profiling_enabled(True)
        llm.generate(prompt(20), GREEDY)
        warm = llm.generate(prompt(20) + [9, 9], GREEDY)
        metrics = llm.get_profiling_metrics()
        assert warm.metrics.reused_tokens == metrics.prefill.reused_tokens == 16
        assert metrics.prefill.computed_tokens == 20 + 6

        async def scrape():
            transport = httpx.ASGITransport(app=build_app(llm))
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                return (await client.get("/metrics")).text

        text = asyncio.run(scrape())
    assert "trtedge_profiling_enabled 1.0" in text
    assert "trtedge_profile_generated_tokens_total 8.0" in text
    assert "trtedge_profile_prefill_reused_tokens_total 16.0" in text
    assert 'trtedge_profile_stage_runs_total{stage="llm_prefill"} 2.0' in text
    assert 'trtedge_profile_stage_seconds_total{stage="llm_generation"}' in text
