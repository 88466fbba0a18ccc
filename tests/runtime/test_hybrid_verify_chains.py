"""Speculative verify steps of hybrid models through the decode-graph path (engine core v2: the verify
replays the captured decode step, its recurrent layers running each draft chain node by node inside
it, every node's state kept in the pool's scratch rows for the rollback). On the CPU the graphs are
``EagerGraphs`` taking chains, and the recurrent layers run their torch reference of the chained
Triton kernels (tests/gpu/test_hybrid_graphs_cuda.py compares the kernels with it on CUDA). Greedy
output equals plain greedy decoding for every accepted length, alone and batched, with a context-cache
context-cache snapshot untouched by the chains, and nothing leaks."""

from __future__ import annotations

import pytest

from tests.eager_graphs import EagerGraphs
from tests.runtime.spec_helpers import collect, generate, load, repetitive_prompts
from tests.runtime.test_qwen3_5_speculative import KnowingProposer
from tests.tiny import make_tiny_hybrid_family
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative import SpeculativeConfig

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def family(request, tmp_path_factory):
    model, tokenizer = load(
        make_tiny_hybrid_family(tmp_path_factory.mktemp(request.param) / "m", request.param)
    )
    prompts = repetitive_prompts(6)
    plain, _ = generate(model, tokenizer, prompts, GREEDY, batch=1)
    return model, tokenizer, prompts, plain


def _engine(model, tokenizer, batch: int, **options) -> Engine:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    config = EngineConfig(
        max_batch_size=batch,
        max_kv_cache_capacity=256,
        enable_in_flight_batching=batch > 1,
        speculative=spec,
        **options,
    )
    engine = Engine(model, tokenizer, config)
    engine.runner.graphs = EagerGraphs(engine.runner, verify_chains=True)
    return engine


@pytest.mark.parametrize("batch", [1, 6], ids=["alone", "batched"])
def test_graphed_verify_chains_restore_the_state_of_every_accepted_length(family, batch):
    model, tokenizer, prompts, plain = family
    engine = _engine(model, tokenizer, batch)
    engine.speculative.proposer = KnowingProposer(prompts, plain)
    assert engine.speculative.graph_verify
    assert collect(engine, prompts, GREEDY) == plain
    spec = engine.speculative
    assert spec.graph_steps == spec.verify_steps > 0 and engine.runner.graphs.chain_calls == spec.graph_steps
    assert 0 < spec.stats.accepted_tokens < spec.stats.draft_tokens and spec.stats.mean_accepted_length > 2
    state = engine.blocks.state
    assert state.num_free_slots == state.num_slots
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


class OneRowGraphs(EagerGraphs):
    """Graphs captured for one row: a verify step (k + 1 rows) does not fit them."""

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= 1


def test_a_verify_step_the_graphs_cannot_take_runs_eagerly_between_graphed_steps(family):
    model, tokenizer, prompts, plain = family
    engine = _engine(model, tokenizer, 1)
    engine.runner.graphs = graphs = OneRowGraphs(engine.runner, verify_chains=True)
    engine.speculative.proposer = KnowingProposer(prompts, plain)
    assert collect(engine, prompts, GREEDY, one_by_one=True) == plain
    spec = engine.speculative
    assert spec.verify_steps > 0 and spec.graph_steps == 0 == graphs.chain_calls and graphs.calls > 0
    assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots


def test_the_next_turn_resumes_from_the_prompt_snapshot_after_graphed_verify_chains(family):
    """The first turn publishes its prompt's snapshot (speculating requests checkpoint inside their
    prompt only), then decodes in graphed verify chains, whose scratch rows and live row must leave
    the snapshot as it was: the second turn resumes from it and equals a cold run."""
    model, tokenizer, prompts, _ = family
    prompt = prompts[1] * 2  # 38 tokens
    engine = _engine(model, tokenizer, 1, enable_context_reuse=True)
    try:
        first = [t for d in engine.submit(prompt, GREEDY) for t in d.token_ids]
        metrics = []
        follow = prompt + first[:20] + [7, 8, 9]
        second = [t for d in engine.submit(follow, GREEDY, on_metrics=metrics.append) for t in d.token_ids]
    finally:
        engine.shutdown()
    assert engine.speculative.graph_steps > 0
    cold, _ = generate(model, tokenizer, [follow], GREEDY, batch=1)
    assert second == cold[0]
    assert metrics[0].reused_tokens >= 32
