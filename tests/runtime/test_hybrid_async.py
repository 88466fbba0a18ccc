"""Asynchronous scheduling of hybrid models (forced on the CPU; the default on CUDA): the state of a
request that starts, resumes a snapshot or is preempted is prepared in stream order behind the
step in flight, and checkpoints count the token that step samples. Greedy output equals the
synchronous engine's; every state slot and KV block is freed."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.spec_helpers import load
from tests.tiny import make_tiny_hybrid_family
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.sampling_params import SamplingParams

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def hybrid(request, tmp_path_factory):
    return load(make_tiny_hybrid_family(tmp_path_factory.mktemp(request.param) / "m", request.param))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(hybrid, prompts, asynchronous: bool, params=GREEDY, **config) -> tuple[list[list[int]], Engine]:
    model, tokenizer = hybrid
    options = dict(max_batch_size=3, max_kv_cache_capacity=256, enable_in_flight_batching=True)
    engine = Engine(model, tokenizer, EngineConfig(async_scheduling=asynchronous, **{**options, **config}))
    assert engine.async_scheduling == asynchronous
    try:
        outs = [[t for d in s for t in d.token_ids] for s in [engine.submit(p, params) for p in prompts]]
        assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        engine.shutdown()
    return outs, engine


def test_asynchronous_greedy_equals_synchronous_with_requests_joining_mid_flight(hybrid):
    prompts = [prompt(n, seed) for seed, n in enumerate([20, 37, 5, 50, 16])]
    assert run(hybrid, prompts, True)[0] == run(hybrid, prompts, False)[0]


def test_asynchronous_preemption_recomputes_and_frees_every_state_slot(hybrid):
    prompts = [prompt(20, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected, _ = run(hybrid, prompts, False, params)
    outs, engine = run(
        hybrid, prompts, True, params, max_batch_size=4, max_kv_cache_capacity=64, num_blocks=6
    )
    assert engine.stats.preemptions > 0
    assert outs == expected


def test_a_checkpoint_of_generated_tokens_taken_asynchronously_resumes_the_next_turn(hybrid):
    """The first turn's generated tokens cross block ends while each step's sample is still in
    flight; the second turn reuses a prefix past the first prompt from one of those checkpoints."""
    first = prompt(40, 9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    model, tokenizer = hybrid
    config = EngineConfig(max_kv_cache_capacity=256, enable_context_reuse=True, async_scheduling=True)
    engine = Engine(model, tokenizer, config)
    try:
        out = [t for d in engine.submit(first, params) for t in d.token_ids]
        second = first + out + prompt(5, 10)
        deltas = list(engine.submit(second, params))
    finally:
        engine.shutdown()
    reference, _ = run(hybrid, [second], False, params)
    assert deltas[-1].cached_tokens > len(first)
    assert [t for d in deltas for t in d.token_ids] == reference[0]
