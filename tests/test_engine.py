"""The engine through the public API: in-flight batching from many threads, seeds in a batch,
cancellation, preemption, context reuse, metrics. Tiny checkpoints where any model does, the
embedded SmolLM2 where real text matters."""

from __future__ import annotations

import threading
import time

import pytest

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, CancellableIterator, ConfigError, ContextCacheConfig, SamplingParams
from trtedge.runtime.artifacts.embedded import embedded_model_path
from trtedge.runtime.engine import Engine, EngineConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "qwen2")


def tiny_llm(path, **options) -> LLM:
    return LLM(str(path), **{"max_kv_cache_capacity": 256, "max_input_len": 128, **options})


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 with in-flight batching (batch 8) and context reuse on."""
    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    config = ContextCacheConfig(enabled=True, max_records=1024)
    with LLM(
        max_kv_cache_capacity=2048,
        max_input_len=1200,
        enable_in_flight_batching=True,
        max_batch_size=8,
        context_cache_config=config,
    ) as llm:
        yield llm


def in_threads(fn, args: list) -> list:
    results = [None] * len(args)
    errors = []
    barrier = threading.Barrier(len(args))

    def run(i):
        try:
            barrier.wait()
            results[i] = fn(args[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def wait_until(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


# ---- in-flight batching on SmolLM2 ----------------------------------------------------------

TOPICS = [
    "the sea",
    "a cat",
    "rain",
    "Paris",
    "bread",
    "the moon",
    "trains",
    "music",
    "winter",
    "a forest",
    "coffee",
    "robots",
    "chess",
    "a river",
    "tea",
    "stars",
]


def test_16_threads_chatting_at_once_get_what_each_gets_alone(smol):
    # different lengths, so that seats free up while others generate
    jobs = [
        (
            [{"role": "user", "content": f"Write one sentence about {t}."}],
            SamplingParams(max_tokens=4 + i, temperature=0, reuse_context=False),
        )
        for i, t in enumerate(TOPICS)
    ]
    alone = [smol.chat(*job).token_ids for job in jobs]
    before = smol.stats()["joined_mid_flight"]
    together = in_threads(lambda job: smol.chat(*job).token_ids, jobs)
    assert together == alone
    assert smol.stats()["joined_mid_flight"] > before  # 16 requests, 8 seats: later ones joined mid-flight


def test_seeded_sampled_request_is_the_same_alone_and_in_a_batch(smol):
    mine = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=2**63 + 12345)
    prompt = [{"role": "user", "content": "Tell me a short story about a dragon."}]
    alone = smol.chat(prompt, mine).token_ids
    others = [
        (
            [{"role": "user", "content": f"Name something about {t}."}],
            SamplingParams(max_tokens=20, temperature=1.2),
        )
        for t in TOPICS[:8]
    ]
    jobs = [(prompt, mine)] + others
    outs = in_threads(lambda job: smol.chat(*job).token_ids, jobs)
    assert outs[0] == alone


FACTS = " ".join(
    f"Fact {i}: lighthouse {i} stands on island {i * 7 % 13} and is painted {['red', 'blue', 'green', 'white'][i % 4]}."
    for i in range(54)
)


def lighthouse_chat(question: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer questions about lighthouses. " + FACTS},
        {"role": "user", "content": question},
    ]


def test_second_request_reuses_a_1000_token_prefix_with_unchanged_output(smol):
    first, second = lighthouse_chat("What color is lighthouse 3?"), lighthouse_chat("Where is lighthouse 5?")
    ids = smol.encode_prompt(second)
    shared = next(i for i, (a, b) in enumerate(zip(smol.encode_prompt(first), ids)) if a != b)
    assert shared >= 1000 and len(ids) <= 1200, (shared, len(ids))
    params = SamplingParams(max_tokens=12, temperature=0)
    cold = smol.chat(second, SamplingParams(max_tokens=12, temperature=0, reuse_context=False))
    before = smol.get_context_cache_metrics()
    smol.chat(first, params)
    warm = smol.chat(second, params)
    after = smol.get_context_cache_metrics()
    assert warm.metrics.reused_tokens >= 960
    assert cold.metrics.reused_tokens == 0
    assert warm.token_ids == cold.token_ids
    assert after.hits == before.hits + 1 and after.lookups == before.lookups + 2
    assert after.reused_tokens - before.reused_tokens == warm.metrics.reused_tokens
    assert after.records >= 62 and set(after.to_dict()) == {
        "lookups",
        "hits",
        "reused_tokens",
        "records",
        "evictions",
    }
    print(
        f"TTFT cold {cold.metrics.time_to_first_token:.3f}s, reused {warm.metrics.time_to_first_token:.3f}s"
    )


# ---- engine behaviour on a tiny checkpoint ----------------------------------------------------


def test_batched_prefill_of_prompts_of_different_lengths(tiny_path):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    with tiny_llm(tiny_path) as llm:
        alone = [llm.generate(p, GREEDY).token_ids for p in prompts]
    with tiny_llm(tiny_path, enable_in_flight_batching=True, max_batch_size=4) as llm:
        together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.stats()
    assert together == alone
    assert stats["steps"] < 2 * 12  # decoded together, not one after another


def test_without_in_flight_batching_requests_run_one_at_a_time_in_arrival_order(tiny_path):
    with tiny_llm(tiny_path, max_batch_size=8) as llm:
        order = []
        lengths = (30, 10, 2)
        streams = [
            llm.generate_stream(
                [7, 8, 9],
                SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                on_metrics=lambda m, n=n: order.append(n),
            )
            for n in lengths
        ]
        for s in streams:
            list(s)
        assert wait_until(lambda: len(order) == 3)
        assert order == list(lengths)
        assert llm.stats()["joined_mid_flight"] == 0


def test_priorities_and_min_request_priority(tiny_path):
    with tiny_llm(tiny_path, min_request_priority=-5) as llm:
        with pytest.raises(ValueError, match="priority -6 is below min_request_priority -5"):
            llm.generate([5, 6], GREEDY, priority=-6)
        done = []
        blocker = llm.generate_stream([5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        next(blocker)
        streams = [
            llm.generate_stream([5, 6], GREEDY, priority=p, on_metrics=lambda m, p=p: done.append(p))
            for p in (0, -5, 3, 0)
        ]
        for s in [blocker, *streams]:
            list(s)
        assert wait_until(lambda: len(done) == 4)
        assert done == [3, 0, 0, -5]


def test_context_cache_config_is_validated():
    with pytest.raises(ConfigError, match="max_records"):
        ContextCacheConfig(max_records=-1)
    with pytest.raises(ConfigError, match="unknown key.*max_entries"):
        ContextCacheConfig.coerce({"enabled": True, "max_entries": 3})
    with pytest.raises(ConfigError, match="enabled"):
        ContextCacheConfig.coerce({"enabled": "yes"})
    assert ContextCacheConfig.coerce({"enabled": True}) == ContextCacheConfig(enabled=True, max_records=1024)


def test_cancelling_a_stream_frees_its_blocks_and_seat_at_once(tiny_path):
    with tiny_llm(tiny_path, enable_in_flight_batching=True, max_batch_size=1) as llm:
        total = llm.stats()["kv_blocks_total"]
        metrics = []
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = llm.generate_stream(list(range(5, 60)), params, on_metrics=metrics.append)
        assert isinstance(stream, CancellableIterator)
        deltas = [next(stream), next(stream)]
        waiting = llm.generate_stream([5, 6, 7], GREEDY)  # no seat until the first one goes
        assert llm.stats()["kv_blocks_free"] < total
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(stream))
        reader.start()
        stream.cancel()  # while another thread iterates
        reader.join(timeout=10)
        assert not reader.is_alive()
        final = (deltas + seen)[-1]
        assert final.finish_reason == "cancelled" and len(deltas + seen) < 200
        assert [d.finish_reason for d in list(waiting)][-1] == "length"
        assert wait_until(
            lambda: llm.stats()["kv_blocks_free"] == total and llm.stats()["active_requests"] == 0
        )
        assert wait_until(lambda: len(metrics) == 1)
        time.sleep(0.05)
        [m] = metrics
        assert m.finish_reason == "cancelled" and m.generated_tokens >= 2
        assert llm.stats()["cancelled"] == 1


def test_close_from_another_thread_ends_a_blocked_reader(tiny_path):
    with tiny_llm(tiny_path, enable_in_flight_batching=True, max_batch_size=2) as llm:
        total = llm.stats()["kv_blocks_total"]
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, n=2)
        stream = llm.generate_stream([5, 6, 7], params)
        next(stream)
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(stream))
        reader.start()
        stream.close()
        reader.join(timeout=10)
        assert not reader.is_alive()
        assert list(stream) == []
        assert wait_until(lambda: llm.stats()["kv_blocks_free"] == total)
        with llm.generate_stream([5, 6], GREEDY) as s:  # the context manager closes (and cancels)
            next(s)
        assert wait_until(
            lambda: llm.stats()["kv_blocks_free"] == total and llm.stats()["active_requests"] == 0
        )


def test_metrics_once_per_stream_and_only_with_a_callback(tiny_path):
    with tiny_llm(tiny_path) as llm:
        calls = []
        out = llm.generate([5, 6, 7, 8], GREEDY, on_metrics=calls.append)
        [m] = calls
        assert m is out.metrics
        assert (m.prompt_tokens, m.generated_tokens, m.decoded_tokens) == (4, 12, 11)
        assert m.finish_reason == "length" and m.reused_tokens == 0
        assert 0 < m.prefill_time <= m.time_to_first_token and m.generation_time > 0
        assert m.decode_tokens_per_second == pytest.approx(11 / m.generation_time)
        one = llm.generate([5, 6], SamplingParams(max_tokens=1), on_metrics=calls.append)
        assert one.metrics.decoded_tokens == 0 and one.metrics.decode_tokens_per_second == 0
        assert one.metrics.generated_tokens == 1

        def broken(*args):  # fails once; the engine's restart probe then finds the device working
            llm.engine.runner.run = run
            raise RuntimeError("device on fire")

        run, llm.engine.runner.run = llm.engine.runner.run, broken
        try:
            failed = []
            with pytest.raises(RuntimeError, match="device on fire"):
                list(llm.generate_stream([5, 6], GREEDY, on_metrics=failed.append))
        finally:
            llm.engine.runner.run = run
        assert wait_until(lambda: len(failed) == 1)
        assert failed[0].finish_reason == "error"
        assert llm.generate([5, 6], GREEDY).finish_reason == "length"  # the engine keeps serving
        assert llm.stats()["restarts"] == 1


def test_metrics_reach_the_callback_before_the_reader_sees_the_end(tiny_path):
    """The engine thread hands a request's metrics over before its final delta (or error), so a
    reader whose stream has ended has them: generate() returning leaves no metrics still to come."""
    with tiny_llm(tiny_path, engine_process=False) as llm:
        returned, seen_late = threading.Event(), []

        def slow(m):  # on the engine thread; a reader given the end first would return meanwhile
            time.sleep(0.3)
            seen_late.append(returned.is_set())

        out = llm.generate([5, 6, 7], SamplingParams(max_tokens=2), on_metrics=slow)
        returned.set()
        assert seen_late == [False] and out.metrics is not None


def test_preemption_under_a_tiny_pool_still_gets_every_answer_right(tiny_path):
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]  # 20 tokens + 40 generated: 4 blocks each
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=77, ignore_eos=True)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    jobs = [(p, sampled if i % 2 else greedy) for i, p in enumerate(prompts)]
    with tiny_llm(tiny_path) as llm:
        expected = [llm.generate(p, params).token_ids for p, params in jobs]
        config = EngineConfig(
            max_batch_size=4, max_kv_cache_capacity=64, enable_in_flight_batching=True, num_blocks=6
        )
        engine = Engine(llm.model, llm.tokenizer, config)
    try:
        streams = [engine.submit(p, params, priority=i % 3) for i, (p, params) in enumerate(jobs)]
        outs = [[t for d in s for t in d.token_ids] for s in streams]
        assert engine.stats.preemptions > 0
        assert outs == expected
        assert engine.blocks.num_free_blocks == 6
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit([5, 6], greedy)
    with pytest.raises(ValueError, match="cannot hold one request"):
        Engine(llm.model, llm.tokenizer, EngineConfig(max_kv_cache_capacity=64, num_blocks=3))


def test_n_choices_cancel_together_and_free_the_pool(tiny_path):
    with tiny_llm(tiny_path, enable_in_flight_batching=True, max_batch_size=4) as llm:
        total = llm.stats()["kv_blocks_total"]
        stream = llm.generate_stream(
            list(range(5, 45)), SamplingParams(max_tokens=150, n=3, seed=1, ignore_eos=True)
        )
        seen = set()
        for delta in stream:
            seen.add(delta.index)
            if len(seen) == 3:
                stream.cancel()
        assert wait_until(lambda: llm.stats()["kv_blocks_free"] == total and llm.stats()["running"] == 0)
        assert llm.stats()["cancelled"] == 1


def test_a_request_id_in_flight_is_refused_until_its_request_ends(tiny_path):
    with tiny_llm(tiny_path, enable_in_flight_batching=True, max_batch_size=4) as llm:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        first = llm.generate_stream([5, 6, 7], params, request_id="job-1")
        with pytest.raises(ValueError, match=r"request_id 'job-1' is already in use"):
            llm.generate_stream([8, 9], params, request_id="job-1")
        first.cancel()
        for _ in first:  # drains to its end: the engine has finished it
            pass
        again = llm.generate(
            [8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="job-1"
        )
        assert len(again.token_ids) == 3
        assert llm.engine.num_active == 0
