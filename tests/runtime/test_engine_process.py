"""The engine core in its own process (``LLM(engine_process=True)``, the CUDA default): the same
outputs, streams, cancellation, errors and figures as in-process, through the message queue; and a
core that dies fails its requests with a clear error instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

import pytest

from trtedge import LLM, SamplingParams
from trtedge.runtime.engine import EngineUnavailableError
from trtedge.runtime.output import LoopBatcher, LoopChannel

PROMPTS = ["The capital of France is", "1, 2, 3,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def core(smollm):
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    embedded_model_path()
    llm = LLM(
        engine_process=True,
        max_kv_cache_capacity=2048,
        max_input_len=1024,
        max_batch_size=4,
        enable_in_flight_batching=True,
    )
    yield llm
    llm.close()


def wait_idle(llm: LLM) -> dict:
    time.sleep(0.06)  # stats() may answer with the snapshot of up to 50 ms ago, from before this test's work
    for _ in range(200):
        stats = llm.stats()
        if stats["active_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        time.sleep(0.05)
    return stats


def test_greedy_outputs_logprobs_and_metrics_equal_in_process(core, smollm):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    there = core.generate(PROMPTS, params)
    here = smollm.generate(PROMPTS, params)
    assert [o.token_ids for o in there] == [o.token_ids for o in here]
    assert [o.text for o in there] == [o.text for o in here]
    for a, b in zip(there, here):
        assert [t.token_id for t in a.logprobs] == [t.token_id for t in b.logprobs]
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-4)
        assert (
            a.metrics is not None and a.metrics.generated_tokens == 12 and a.metrics.finish_reason == "length"
        )
    assert core.describe()["engine_process"] is True and smollm.describe()["engine_process"] is False
    assert core.describe()["vocab_size"] == smollm.describe()["vocab_size"]


def test_n_choices_stop_strings_and_prompt_logprobs_cross_the_queue(core, smollm):
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=2, stop=["\n"], prompt_logprobs=1)
    there, here = core.generate(PROMPTS[0], params), smollm.generate(PROMPTS[0], params)
    assert [o.text for o in there.outputs] == [o.text for o in here.outputs]
    assert len(there.prompt_logprobs) == there.prompt_tokens and there.prompt_logprobs[0] is None
    assert [p.token_id for p in there.prompt_logprobs[1:]] == [p.token_id for p in here.prompt_logprobs[1:]]


def test_text_is_made_on_the_client_side_and_a_stop_string_stops_the_core(core, smollm):
    """The core sends token ids only; this side detokenizes, cuts at a stop string and tells the core
    to stop the choice there: the same text, tokens, counts, metrics and statistics as in-process,
    and the tokens the core made past the stop string are dropped."""
    params = SamplingParams(max_tokens=40, temperature=0, stop=[" 7", "\n\n"], n=2)
    before = core.stats()["completed"]
    metrics = []
    there = core.generate(PROMPTS[1], params, on_metrics=metrics.append)
    here = smollm.generate(PROMPTS[1], params)
    assert here.finish_reason == "stop" and here.completion_tokens < 2 * 40  # a stop string was hit
    for a, b in zip(there.outputs, here.outputs):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    assert there.completion_tokens == here.completion_tokens
    assert metrics and metrics[0].generated_tokens == here.completion_tokens
    assert metrics[0].finish_reason == "stop"
    streamed = "".join(d.text for d in core.generate_stream(PROMPTS[1], replace(params, n=1)))
    assert streamed == here.outputs[0].text
    stats = wait_idle(core)
    assert stats["completed"] == before + 2 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_cancel_mid_stream_frees_the_seat_and_blocks(core):
    stream = core.generate_stream("Tell me a long story", SamplingParams(max_tokens=500, temperature=0))
    deltas = []
    for delta in stream:
        deltas.append(delta)
        if len(deltas) == 3:
            stream.cancel()
    assert deltas[-1].finish_reason == "cancelled" and len(deltas) < 50
    stats = wait_idle(core)
    assert stats["active_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["cancelled"] >= 1


def test_loop_channel_gets_a_steps_deltas_on_its_event_loop(core):
    async def main() -> list:
        loop = asyncio.get_running_loop()
        got, done = [], asyncio.Event()

        def deliver(item):
            got.append(item)
            if getattr(item, "finish_reason", None) is not None:
                done.set()

        channel = LoopChannel(LoopBatcher(loop), deliver)
        core.generate_stream(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0), channel=channel)
        await asyncio.wait_for(done.wait(), 120)
        return got

    got = asyncio.run(main())
    assert sum(len(d.token_ids) for d in got) == 6 and got[-1].finish_reason == "length"


def test_bad_input_is_refused_at_the_call_and_the_core_keeps_serving(core):
    with pytest.raises(ValueError, match="logit_bias token id 99999999"):
        core.generate("hi", SamplingParams(max_tokens=2, logit_bias={99999999: 1.0}))
    with pytest.raises(ValueError):
        core.compile_guide({"json": {"type": "object", "properties": 5}})
    bad_guide = SamplingParams(max_tokens=2, guided_decoding={"json": {"type": "object", "properties": 5}})
    with pytest.raises(ValueError):  # at the call, as in-process: not an engine error in the stream
        core.generate("hi", bad_guide)
    assert core.generate("hi", SamplingParams(max_tokens=2, temperature=0)).completion_tokens == 2
    metrics = core.get_context_cache_metrics()
    assert metrics.lookups >= 0 and core.get_profiling_metrics() is not None


def test_a_dead_core_fails_open_requests_and_refuses_new_ones():
    llm = LLM(engine_process=True, max_kv_cache_capacity=1024, max_input_len=512)
    try:
        stream = llm.generate_stream("Count to a thousand", SamplingParams(max_tokens=900, temperature=0))
        next(stream)
        os.kill(llm.engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match="engine core process exited"):
            for _ in stream:
                pass
        with pytest.raises(EngineUnavailableError):
            llm.generate("hi", SamplingParams(max_tokens=2))
        assert "exited" in llm.stats()["engine_error"]
    finally:
        llm.close()


def test_a_metrics_callback_may_call_back_into_the_llm(core):
    """on_metrics runs on the client's output thread: calling the LLM from it must not deadlock."""
    seen = []
    out = core.generate(
        "hi",
        SamplingParams(max_tokens=3, temperature=0),
        on_metrics=lambda m: seen.append((m.generated_tokens, core.stats()["submitted"])),
    )
    assert out.completion_tokens == 3 and seen and seen[0][0] == 3 and seen[0][1] >= 1


def test_an_llm_dropped_without_close_stops_its_core_process():
    import gc

    llm = LLM(engine_process=True, max_kv_cache_capacity=512, max_input_len=256)
    proc, folder = llm.engine._proc, llm.engine._dir
    assert llm.generate("hi", SamplingParams(max_tokens=2, temperature=0)).completion_tokens == 2
    del llm
    gc.collect()
    assert proc.wait(timeout=60) is not None and not os.path.exists(folder)


def test_a_slow_call_does_not_hold_up_a_cancel(monkeypatch, core):
    """The core answers calls on threads of their own: while a call is being answered (made 4 s slow by
    the test fault), a cancellation behind it still ends the stream."""
    import threading

    monkeypatch.setenv("TRTEDGE_TEST_FAULT", "slow_call=4")
    with LLM(engine_process=True, max_kv_cache_capacity=1024, max_input_len=512) as llm:
        stream = llm.generate_stream("Tell me a long story", SamplingParams(max_tokens=400, temperature=0))
        first = next(stream)
        answered = []
        call = threading.Thread(target=lambda: answered.append(llm.speculative_metrics()))
        call.start()
        time.sleep(0.5)  # the call is on its way to the core
        stream.cancel()
        deltas = [first, *stream]
        assert deltas[-1].finish_reason == "cancelled"
        assert call.is_alive() and not answered  # the cancel was handled while the call was pending
        call.join(timeout=60)
        assert answered == [None]  # no speculative decoding: its metrics are None


def test_the_core_freezes_its_startup_heap_and_counts_its_collections(core, smollm):
    core.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    gc_stats = core.stats()["gc"]
    assert len(gc_stats["collections"]) == 3 and all(n >= 0 for n in gc_stats["collections"])
    assert len(gc_stats["seconds"]) == 3
    # the model's and the kernels' objects sit outside the collector in the core, not in-process
    assert gc_stats["frozen_objects"] > 10_000
    assert "gc" not in smollm.stats()


def test_gc_pauses_time_each_collection_by_generation():
    import gc

    from trtedge.runtime.profiling import GcPauses

    pauses = GcPauses()
    try:
        gc.collect(1)
        gc.collect()
        counted = pauses.as_dict()
    finally:
        pauses.close()
    assert counted["collections"][1] >= 1 and counted["collections"][2] >= 1
    assert counted["seconds"][2] > 0
    gc.collect()
    assert pauses.as_dict() == counted  # closed: no longer counting
