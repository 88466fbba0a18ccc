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
