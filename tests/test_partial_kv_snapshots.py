"""Partial KV snapshots (ContextCacheConfig(partial_kv_snapshot_pool_bytes=...)): a prefix that ends
inside a KV block is reused whole, from a copy of that last partial block; greedy output is the same
as without reuse; the pool is bounded and counts its evictions."""

from __future__ import annotations

import pytest

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, ConfigError, ContextCacheConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
POOL = 1 << 20


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "qwen2")


def tiny_llm(path, pool: int | None = POOL, **options) -> LLM:
    reuse = None if pool is None else ContextCacheConfig(enabled=True, partial_kv_snapshot_pool_bytes=pool)
    return LLM(str(path), max_kv_cache_capacity=256, max_input_len=128, context_cache_config=reuse, **options)


def prompt(n: int, start: int = 5) -> list[int]:
    return [5 + (start + 7 * i) % 500 for i in range(n)]


def scribble(llm: LLM) -> None:
    """Overwrite the blocks freed last (a freed partial block is handed out first): a reuse must
    come from the snapshot, not from the block it was taken from."""
    llm.generate(prompt(60, 300), SamplingParams(max_tokens=2, temperature=0, reuse_context=False))


@pytest.fixture(scope="module")
def cold(tiny_path):
    """Greedy outputs without any reuse: the reference."""
    with tiny_llm(tiny_path, pool=None) as llm:
        yield lambda ids: llm.generate(ids, GREEDY).token_ids


def test_a_prefix_ending_inside_a_block_is_reused_whole_with_unchanged_output(tiny_path, cold):
    first = prompt(40)  # two full blocks and 8 tokens
    with tiny_llm(tiny_path) as llm:
        llm.generate(first, GREEDY)
        scribble(llm)
        longer = llm.generate(first + [11, 12, 13], GREEDY)
        scribble(llm)
        again = llm.generate(first, GREEDY)  # the same prompt: all but its last token
        metrics = llm.get_context_cache_metrics()
    assert longer.metrics.reused_tokens == 40 and again.metrics.reused_tokens == 39
    assert longer.token_ids == cold(first + [11, 12, 13])
    assert again.token_ids == cold(first)
    assert metrics.reused_tokens == 79 and metrics.partial_kv_reused_tokens == 8 + 7
    assert metrics.partial_kv_snapshots >= 1 and metrics.partial_kv_snapshot_evictions == 0
    with tiny_llm(tiny_path, pool=0) as llm:  # the default: full blocks only
        llm.generate(first, GREEDY)
        assert llm.generate(first + [11, 12, 13], GREEDY).metrics.reused_tokens == 32
        assert llm.get_context_cache_metrics().partial_kv_snapshots is None


def test_a_short_prompt_and_a_generated_tail_are_reused(tiny_path, cold):
    short = prompt(10, 100)  # no full block at all
    with tiny_llm(tiny_path) as llm:
        first = llm.generate(short, GREEDY)
        turn = (
            short + first.token_ids + [21, 22]
        )  # the prompt, its answer (a 16-token block ends inside), more
        second = llm.generate(turn, GREEDY)
        assert llm.generate(short + [1], GREEDY).metrics.reused_tokens == 10
    assert second.metrics.reused_tokens == 15  # 10 + 6 generated, of which the last is not computed
    assert second.token_ids == cold(turn)


def test_batched_requests_sharing_a_partial_prefix_match_no_reuse(tiny_path, cold):
    system = prompt(21, 200)
    prompts = [system + [30 + i] * (i + 1) for i in range(4)]
    with tiny_llm(tiny_path, enable_in_flight_batching=True, max_batch_size=4) as llm:
        llm.generate(system + [1], GREEDY)
        scribble(llm)
        outs = llm.generate(prompts, GREEDY)
    assert [o.metrics.reused_tokens for o in outs] == [21] * 4
    assert [o.token_ids for o in outs] == [cold(p) for p in prompts]


def test_the_pool_is_bounded_and_counts_evictions(tiny_path, cold):
    with tiny_llm(tiny_path) as llm:
        per_snapshot = llm.engine.runner.partial_kv_bytes_per_snapshot
    latest = prompt(20, 183)
    tail = [next(t for t in (7, 8) if t != cold(latest)[0])]  # not what the model answered
    with tiny_llm(tiny_path, pool=2 * per_snapshot + 1) as llm:
        metrics = llm.get_context_cache_metrics()
        assert metrics.partial_kv_snapshot_capacity == 2
        assert metrics.partial_kv_snapshot_pool_bytes == 2 * per_snapshot
        # distinct 20-token prompts: a snapshot at 20 tokens, replaced by the one at 25 that covers it
        for i in range(4):
            llm.generate(prompt(20, 60 * i + 3), GREEDY)
        scribble(llm)
        metrics = llm.get_context_cache_metrics()
        assert metrics.partial_kv_snapshots == 2 and metrics.partial_kv_snapshot_evictions == 2
        warm = llm.generate(latest + tail, GREEDY)  # the latest prompt's snapshot is still there
        evicted = llm.generate(prompt(20, 3) + tail, GREEDY)
    assert warm.metrics.reused_tokens == 20 and evicted.metrics.reused_tokens == 16
    assert warm.token_ids == cold(latest + tail)


def test_cache_salts_never_share_a_partial_block(tiny_path):
    ids = prompt(30)
    with tiny_llm(tiny_path) as llm:
        llm.generate(ids, SamplingParams(max_tokens=2, temperature=0, cache_salt="a"))
        other = llm.generate(ids + [1], SamplingParams(max_tokens=2, temperature=0, cache_salt="b"))
        same = llm.generate(ids + [1], SamplingParams(max_tokens=2, temperature=0, cache_salt="a"))
    assert other.metrics.reused_tokens == 0 and same.metrics.reused_tokens == 30


def test_the_pool_size_is_validated():
    with pytest.raises(ConfigError, match="--context-cache-partial-kv-snapshot-pool-bytes"):
        ContextCacheConfig(partial_kv_snapshot_pool_bytes=-1)
    with pytest.raises(ConfigError, match="--context-cache-partial-kv-snapshot-pool-bytes"):
        ContextCacheConfig(partial_kv_snapshot_pool_bytes=True)
    from trtedge.config import LaunchConfig

    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        LaunchConfig(
            context_cache=ContextCacheConfig(enabled=True, partial_kv_snapshot_pool_bytes=POOL),
            tensor_parallel_size=2,
        )
