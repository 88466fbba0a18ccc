"""Speculative decoding and jump-forward drafts on a hybrid model (Qwen3.5): rejected draft tokens
roll the recurrent state back to the accepted prefix, so greedy output equals plain greedy decoding."""

from __future__ import annotations

import pytest

from tests.runtime.spec_helpers import collect, generate, load, repetitive_prompts
from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.executor.runner import ModelRunner
from trtedge.runtime.sampling_params import GuidedDecodingParams, SamplingParams
from trtedge.runtime.speculative import SpeculativeConfig, UnsupportedSpeculativeMethod
from trtedge.runtime.speculative.tree import Draft

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load(make_tiny_hybrid_checkpoint(tmp_path_factory.mktemp("q35") / "m", vision=False))


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(6)


@pytest.fixture(scope="module")
def plain(target, prompts):
    outs, _ = generate(*target, prompts, GREEDY, batch=1)
    return outs


def assert_nothing_leaked(engine) -> None:
    state = engine.blocks.state
    assert state.num_free_slots == state.num_slots
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("batch", [1, 6], ids=["alone", "batched"])
def test_ngram_greedy_equals_plain_greedy(target, prompts, plain, batch):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    outs, engine = generate(*target, prompts, GREEDY, speculative=spec, batch=batch)
    assert outs == plain
    assert engine.speculative.stats.draft_tokens > 0
    assert_nothing_leaked(engine)


class KnowingProposer:
    """Drafts the true greedy continuation with one wrong token at a rotating place (or none), so that
    every accepted length 0..k occurs and the state is restored at each window position."""

    def __init__(self, prompts, outputs):
        self.truth = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.calls = 0

    def propose(self, seqs, limits):
        drafts = []
        for seq, k in zip(seqs, limits):
            truth = self.truth[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            tokens = list(truth[seq.num_output_tokens : seq.num_output_tokens + k])
            wrong = self.calls % (k + 1)
            if wrong < len(tokens):
                tokens[wrong] = (tokens[wrong] + 1) % 500 + 3
            self.calls += 1
            drafts.append(Draft.chain(tokens) if tokens else None)
        return drafts

    def verified(self, seq, draft, path, aux) -> None:
        pass

    def observe(self, seqs, num_tokens, aux) -> None:
        pass

    def release(self, seq) -> None:
        pass


@pytest.mark.parametrize("batch", [1, 6], ids=["alone", "batched"])
def test_every_accepted_length_restores_the_state(target, prompts, plain, batch):
    model, tokenizer = target
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    config = EngineConfig(
        max_batch_size=batch, max_kv_cache_capacity=256, enable_in_flight_batching=batch > 1, speculative=spec
    )
    engine = Engine(model, tokenizer, config)
    engine.speculative.proposer = KnowingProposer(prompts, plain)
    assert collect(engine, prompts, GREEDY) == plain
    stats = engine.speculative.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and stats.mean_accepted_length > 2
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("batch", [1, 6], ids=["alone", "batched"])
def test_draft_model_greedy_equals_plain_greedy(target, prompts, plain, batch, tmp_path_factory):
    draft_path = make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "d", "qwen2", seed=3)
    draft, _ = load(draft_path)
    spec = SpeculativeConfig(method="draft_model", model=str(draft_path), num_speculative_tokens=3)
    outs, engine = generate(*target, prompts, GREEDY, speculative=spec, draft=draft, batch=batch)
    assert outs == plain
    assert engine.speculative.stats.draft_tokens > 0
    assert_nothing_leaked(engine)


def test_trees_and_hybrid_drafts_are_refused(target, tmp_path):
    model, tokenizer = target
    eagle = SpeculativeConfig(method="eagle3", model="head", draft_top_k=2, num_speculative_tokens=2)
    with pytest.raises(UnsupportedSpeculativeMethod, match="eagle3 is not supported with hybrid.*chains"):
        Engine(model, tokenizer, EngineConfig(speculative=eagle))
    spec = SpeculativeConfig(method="draft_model", model="d")
    with pytest.raises(ValueError, match="speculative_config.model .*hybrid draft model .*not supported"):
        Engine(model, tokenizer, EngineConfig(speculative=spec), draft=model)


def test_reuse_publishes_the_prompt_snapshot_and_refuses_cache_generated_tokens(target, prompts, plain):
    model, tokenizer = target
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    config = EngineConfig(max_kv_cache_capacity=256, enable_context_reuse=True, speculative=spec)
    engine = Engine(model, tokenizer, config)
    try:
        with pytest.raises(ValueError, match="^cache_generated_tokens must not be true with speculative"):
            engine.submit(prompts[0], SamplingParams(max_tokens=4, cache_generated_tokens=True))
        ok = SamplingParams(max_tokens=4, cache_generated_tokens=True, disable_spec_decode=True)
        list(engine.submit(prompts[0], ok))  # a request that does not speculate may cache its output
        prompt = prompts[1] * 2  # 38 tokens: a snapshot at 32
        first = [t for d in engine.submit(prompt, GREEDY) for t in d.token_ids]
        state = engine.blocks.state
        published = state.stats.published
        metrics = []
        second = engine.submit(prompt + first[:5], GREEDY, on_metrics=metrics.append)
        second_ids = [t for d in second for t in d.token_ids]
        assert state.stats.published == published  # only prompt-end snapshots: none past the prompt
        assert metrics[0].reused_tokens == 32
    finally:
        engine.shutdown()
    assert_nothing_leaked(engine)
    cold, _ = generate(model, tokenizer, [prompt + first[:5]], GREEDY, batch=1)
    assert second_ids == cold[0]


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight-budget"])
def test_jump_forward_drafts_roll_the_recurrent_state_back(target, prompts, plain, tight):
    """Jump-forward through the runner's draft path: a stand-in proposer drafts partly wrong tokens (a
    real guide forces tokens that the word-level test vocabulary tokenizes one way only, so they would
    never be rejected). Tight: four short requests decode under a 16-token budget that cannot hold
    every draft whole; the scheduler drops those drafts rather than split them, and nothing recomputes
    (``rollback`` would raise)."""
    model, tokenizer = target
    guide = GuidedDecodingParams(regex="(w[0-9]+)*", jump_forward=True)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, guided_decoding=guide)
    if tight:
        prompts = [p[:3] for p in prompts[:4]]
        plain, _ = generate(model, tokenizer, prompts, GREEDY, batch=1)
    knowing = KnowingProposer(prompts, plain)

    def propose(seq):
        limit = min(4, seq.params.max_tokens - seq.num_output_tokens - 1)
        [draft] = knowing.propose([seq], [limit]) if limit > 0 else [None]
        if draft is not None:
            seq.token_ids.extend(draft.tokens)
            seq.num_draft_tokens = len(draft)

    rolled, split, dropped = [], [], []
    rollback, run = ModelRunner.rollback, ModelRunner.run

    def counting_rollback(runner, seq, num_computed):
        rolled.append(num_computed)
        return rollback(runner, seq, num_computed)  # raises where the kept states do not reach

    def checking_run(runner, batch):
        for seq, n in zip(batch.seqs, batch.num_tokens):
            end, k = seq.num_computed_tokens + n, seq.num_draft_tokens
            split.append(k > 0 and seq.num_tokens - k - 1 < end < seq.num_tokens)
        return run(runner, batch)

    config = EngineConfig(
        max_batch_size=len(prompts),
        max_kv_cache_capacity=256,
        enable_in_flight_batching=True,
        max_num_batched_tokens=16 if tight else 2048,
    )
    engine = Engine(model, tokenizer, config)
    engine.guides.propose = propose
    engine.runner.rollback = counting_rollback.__get__(engine.runner)
    engine.runner.run = checking_run.__get__(engine.runner)
    chunk = engine.scheduler._chunk

    def counting_chunk(seq, budget):
        k = seq.num_draft_tokens
        n = chunk(seq, budget)
        dropped.append(k > 0 and seq.num_draft_tokens == 0)
        return n

    engine.scheduler._chunk = counting_chunk
    metrics = []
    try:
        streams = [engine.submit(p, params, on_metrics=metrics.append) for p in prompts]
        outs = [[t for d in s for t in d.token_ids] for s in streams]
    finally:
        engine.shutdown()
    assert outs == plain
    assert engine.stats.restarts == 0 and rolled and not any(split)
    assert any(dropped) == tight
    jumped = sum(m.jump_forward_tokens for m in metrics)
    assert 0 < jumped < sum(m.generated_tokens for m in metrics)
    assert_nothing_leaked(engine)


@pytest.mark.parametrize(
    ("spec_tokens", "batch", "budget", "rows"),
    [(None, 6, 2048, 30), (4, 6, 2048, 30), (6, 6, 2048, 42), (6, 6, 16, 16)],
    ids=["jump-only", "spec4", "spec6", "budget"],
)
def test_draft_window_rows_are_allocated_at_start(target, prompts, spec_tokens, batch, budget, rows):
    """The per-position states of draft windows live in rows allocated with the pool, sized for the
    largest step (seats x (max(verify width, jump cap) + 1), at most the token budget): serving never
    allocates more, and jump-forward drafts on hybrid models are capped to fit."""
    model, tokenizer = target
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens) if spec_tokens else None
    config = EngineConfig(
        max_batch_size=batch,
        max_kv_cache_capacity=256,
        enable_in_flight_batching=True,
        max_num_batched_tokens=budget,
        speculative=spec,
    )
    engine = Engine(model, tokenizer, config)
    states = engine.runner.states
    scratch = states.step_ssm.data_ptr()
    try:
        assert states.num_window_rows == rows == states.step_conv.shape[1] == states.step_ssm.shape[1]
        assert (
            states.nbytes == (2 * batch + states.num_snapshots + 1 + rows) * states.row_bytes
        )  # + the padding row
        assert engine.guides.max_jump_tokens == max(4, spec_tokens or 0)
        streams = [engine.submit(p, GREEDY) for p in prompts[:batch]]
        for s in streams:
            list(s)
        assert states.step_ssm.data_ptr() == scratch  # never reallocated while serving
        with pytest.raises(RuntimeError, match="internal error: .* recurrent state rows, .* were allocated"):
            states.scratch(rows + 1)
    finally:
        engine.shutdown()


def test_rollback_of_a_sequence_the_last_step_did_not_run_raises(target):
    """No window entry does not mean "the state is current": rollback refuses it."""
    model, tokenizer = target
    engine = Engine(model, tokenizer, EngineConfig(max_kv_cache_capacity=64))
    try:
        stranger = Sequence([1, 2, 3], GREEDY)
        with pytest.raises(KeyError):
            engine.runner.rollback(stranger, 3)
    finally:
        engine.shutdown()


def test_a_hybrid_draft_model_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    import trtedge.llm
    from trtedge import LLM, ConfigError

    target_path = make_tiny_checkpoint(tmp_path / "t", "qwen2")
    draft_path = make_tiny_hybrid_checkpoint(tmp_path / "d", vision=False)
    loaded = []
    monkeypatch.setattr(trtedge.llm, "load_model", lambda source, **kw: loaded.append(source))
    spec = {"method": "draft_model", "model": str(draft_path)}
    with pytest.raises(
        ConfigError, match=r"^speculative_config.model \(--speculative-config model\): a hybrid"
    ):
        LLM(str(target_path), speculative_config=spec, dtype="float32", cache_dir=str(tmp_path / "cache"))
    assert loaded == []
