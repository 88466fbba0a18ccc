"""Asynchronous scheduling (the host reads each step's samples one step late, the next step takes its
input ids from the device) gives exactly the tokens of the synchronous engine. It runs on CUDA by
default; here it is forced on the CPU, where the bookkeeping is the same."""

from __future__ import annotations

import pytest

from tests.eager_graphs import EagerGraphs
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.core.scheduler import Scheduler, SchedulerConfig
from trtedge.runtime.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "qwen2")
    with LLM(str(path), max_kv_cache_capacity=256, max_input_len=128) as llm:
        yield llm


def run(llm, jobs, overlap: bool, **config):
    options = dict(max_batch_size=4, max_kv_cache_capacity=128, enable_in_flight_batching=True)
    engine = Engine(
        llm.model, llm.tokenizer, EngineConfig(**{**options, **config, "async_scheduling": overlap})
    )
    try:
        assert engine.async_scheduling is overlap
        streams = [engine.submit(p, params) for p, params in jobs]
        outs = []
        for s in streams:
            deltas = list(s)
            outs.append(
                (
                    [t for d in deltas for t in d.token_ids],
                    "".join(d.text for d in deltas),
                    deltas[-1].finish_reason,
                )
            )
        return outs, engine.stats.preemptions, engine.blocks.num_free_blocks, engine.num_blocks
    finally:
        engine.shutdown()


def test_overlapped_steps_give_the_synchronous_tokens_text_and_finish_reasons(tiny):
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(6)]
    jobs = [
        (prompts[0], SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=23, temperature=0.8, seed=5, ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=9, temperature=1.0, top_k=20, top_p=0.9, seed=3)),
        (prompts[3], SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True)),
        (prompts[4], SamplingParams(max_tokens=12, temperature=0.7, n=2, seed=11, ignore_eos=True)),
        (prompts[5], SamplingParams(max_tokens=1, temperature=0)),
    ]
    sync, *_ = run(tiny, jobs, overlap=False)
    overlapped, _, free, total = run(tiny, jobs, overlap=True)
    assert overlapped == sync
    assert free == total  # every block came back, including those of rows computed past a finish


def test_overlapped_steps_stop_on_a_stop_token_like_the_synchronous_engine(tiny):
    probe = run(tiny, [(list(range(40, 60)), SamplingParams(max_tokens=20, temperature=0))], overlap=False)[0]
    stop = probe[0][0][5]  # the sixth generated token ends the next run one row early
    jobs = [(list(range(40, 60)), SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop]))]
    sync, *_ = run(tiny, jobs, overlap=False)
    overlapped, _, free, total = run(tiny, jobs, overlap=True)
    assert overlapped == sync
    assert sync[0][2] == "stop" and len(sync[0][0]) <= 6
    assert free == total


def test_overlapped_steps_survive_preemption_in_a_tiny_pool(tiny):
    jobs = [
        (
            list(range(10 + i, 30 + i)),
            SamplingParams(max_tokens=40, temperature=1.0 if i % 2 else 0, seed=77, ignore_eos=True),
        )
        for i in range(6)
    ]
    sync, *_ = run(tiny, jobs, overlap=False, max_kv_cache_capacity=64, num_blocks=6)
    overlapped, preemptions, free, total = run(
        tiny, jobs, overlap=True, max_kv_cache_capacity=64, num_blocks=6
    )
    assert preemptions > 0
    assert overlapped == sync
    assert free == total


def test_scheduler_does_not_schedule_a_row_whose_in_flight_sample_ends_it():
    blocks = BlockManager(16, 4)
    scheduler = Scheduler(
        SchedulerConfig(max_batch_size=2, enable_in_flight_batching=True, max_seq_len=12), blocks
    )
    short = Sequence([1, 2, 3], SamplingParams(max_tokens=2))
    full = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=50))
    for seq in (short, full):
        scheduler.add(seq)
    first = scheduler.schedule()
    assert first.num_tokens == [3, 10]
    for seq, n in zip(first.seqs, first.num_tokens):
        seq.num_computed_tokens += n
        seq.num_inflight = 1  # sampled on the device, not read back yet
    second = scheduler.schedule()
    assert second.seqs == [short, full] and second.num_tokens == [1, 1]  # inputs read from the device
    for seq in second.seqs:
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)  # the first sample read back; the second is in flight
    # short: 1 token read + 1 in flight = max_tokens 2; full: 11 + 1 = max_seq_len 12: nothing to compute
    assert scheduler.schedule().is_empty


@pytest.mark.parametrize("overlap", [False, True])
def test_a_one_token_prefill_chunk_in_a_decode_graph_step_is_not_sampled(tiny, overlap):
    """15 requests decode while a 16th prefills with the token budget's last token: a step of one-token
    rows (the decode graphs' shape) in which one row is a prefill chunk short of its prompt's end. Its
    logits must not be sampled (that once failed the step: 16 logits rows for 15 samples)."""
    config = EngineConfig(
        max_batch_size=16,
        max_kv_cache_capacity=128,
        max_num_batched_tokens=16,
        enable_in_flight_batching=True,
        async_scheduling=overlap,
    )
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    # one-token prompts: every step is 15 one-token rows plus the 16th prompt's one-token chunk
    prompts = [[5 + i] for i in range(15)] + [list(range(10, 50))]
    engine = Engine(tiny.model, tiny.tokenizer, config)
    engine.runner.graphs = graphs = EagerGraphs(engine.runner)
    try:
        streams = [engine.submit(p, params) for p in prompts]
        got = [[t for d in s for t in d.token_ids] for s in streams]
    finally:
        engine.shutdown()
    assert graphs.calls > 0 and engine.stats.restarts == 0 and engine.stats.failed == 0
    alone = [tiny.generate(p, params).token_ids for p in (prompts[0], prompts[-1])]
    assert [got[0], got[-1]] == alone
