"""MTP speculative decoding: the multi-token-prediction layers a Qwen3.5 checkpoint ships (``mtp.*``,
written here beside a tiny random model) draft chains; drafts equal a straightforward torch reference
of the published layout (transformers' decoder layer inside it), greedy output equals plain decoding,
and every KV block, state slot and draft row is freed."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.mtp_tiny import NemotronReference, Reference, add_mtp_layers, add_nemotron_mtp_layers
from tests.runtime.spec_helpers import generate, host_drafts, load, repetitive_prompts
from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint, make_tiny_nemotron_h_checkpoint
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative import (
    SpeculativeConfig,
    SpeculativeConfigError,
    UnsupportedSpeculativeMethod,
)
from trtedge.runtime.speculative.draft_cache import DraftCache, DraftState, Row
from trtedge.runtime.speculative.mtp import load_mtp

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["dense", "moe"])
def mtp_model(request, tmp_path_factory):
    moe = request.param == "moe"
    path = make_tiny_hybrid_checkpoint(tmp_path_factory.mktemp("mtp") / "m", vision=False, moe=moe)
    tensors = add_mtp_layers(path, moe=moe)
    model, tokenizer = load(path)
    return path, model, tokenizer, tensors, moe


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(8)


@pytest.fixture(scope="module")
def plain(mtp_model, prompts):
    _, model, tokenizer, _, _ = mtp_model
    outs, _ = generate(model, tokenizer, prompts, GREEDY, batch=8)
    return outs


def mtp_spec(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k)


def head_for(path, model):
    return load_mtp(resolve_checkpoint(str(path)), model)


def assert_nothing_leaked(engine) -> None:
    state = engine.blocks.state
    assert state.num_free_slots == state.num_slots
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    cache = engine.speculative.proposer.cache
    assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks


def test_mtp_drafts_match_a_torch_reference_of_the_published_layout(mtp_model, prompts):
    """Every chain the proposer drafts inside a running engine (prefill catch-up, then rows of the
    accepted tokens after each verification) equals the reference's chain recomputed from scratch
    over the same tokens with transformers' target hidden states; the head's first-step logits on the
    prompt match the reference's."""
    path, model, tokenizer, tensors, moe = mtp_model
    reference = Reference(path, tensors, moe)
    head = head_for(path, model)
    prompt = prompts[0]
    hidden = reference.target_hidden(prompt[:-1])
    cache = DraftCache(1, model.cfg.num_kv_heads, model.cfg.head_dim, 8, 16, torch.float32, model.device)
    st = DraftState()
    cache.reserve(st, len(prompt))
    row = Row(st, prompt[1:], list(range(len(prompt) - 1)), 0)
    ids, positions, attn = cache.attention_batch([row])
    logits, out = head.forward(ids, hidden, positions, cache.kv_caches, attn)
    expected, expected_out = reference.rows(hidden, prompt[1:], list(range(len(prompt) - 1)))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)

    engine = Engine(
        model, tokenizer, EngineConfig(max_kv_cache_capacity=256, speculative=mtp_spec(3)), draft=head
    )
    proposer = engine.speculative.proposer
    calls, steps = [], []  # per proposal: the tokens and the draft; the logits of each step's last row
    propose, forward = proposer.propose, head.forward

    def recording_propose(seqs, limits):
        steps.clear()
        drafts = proposer_propose(seqs, limits)
        calls.extend(
            (list(s.token_ids), d.tokens, list(steps))
            for s, d in zip(seqs, host_drafts(drafts))
            if d is not None
        )
        return drafts

    def recording_forward(*args):
        logits, out = forward(*args)
        steps.append(logits[-1].clone())
        return logits, out

    proposer_propose = propose
    proposer.propose = recording_propose
    head.forward = recording_forward
    try:
        list(engine.submit(prompts[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    finally:
        engine.shutdown()
    assert len(calls) >= 3 and max(len(draft) for _, draft, _ in calls) == 3
    # after the prefill, then after two verifications (MoE: the prefill's; transformers' MoE is slow)
    for tokens, draft, logits in calls[: 1 if moe else 3]:
        expected, expected_logits = reference.chain(tokens, len(draft))
        assert draft == expected
        torch.testing.assert_close(torch.stack(logits), torch.stack(expected_logits), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 8], ids=["alone", "batch-of-8"])
def test_mtp_greedy_equals_plain_greedy_and_frees_everything(mtp_model, prompts, plain, batch):
    path, model, tokenizer, _, _ = mtp_model
    outs, engine = generate(
        model, tokenizer, prompts, GREEDY, speculative=mtp_spec(3), draft=head_for(path, model), batch=batch
    )
    assert outs == plain
    stats = engine.speculative.stats
    assert stats.steps > 0 and stats.draft_tokens >= 3 * stats.steps // 2
    assert_nothing_leaked(engine)


def test_mtp_sampled_requests_and_opt_outs_share_a_batch(mtp_model, prompts, plain):
    """Seeded sampled requests beside greedy ones and ones with disable_spec_decode: the greedy ones
    equal plain decoding, and a second round repeats the first exactly (no draft state outlives its
    request)."""
    path, model, tokenizer, _, _ = mtp_model
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, disable_spec_decode=i % 3 == 1)
        for i in range(len(prompts))
    ]
    outs, engine = generate(
        model, tokenizer, prompts, params, speculative=mtp_spec(2), draft=head_for(path, model), rounds=2
    )
    assert outs[: len(prompts)] == outs[len(prompts) :]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [outs[i] for i in greedy] == [plain[i][:16] for i in greedy]
    assert_nothing_leaked(engine)


def test_mtp_is_refused_naming_what_is_missing(tmp_path):
    bare = make_tiny_hybrid_checkpoint(tmp_path / "bare", vision=False)
    model, tokenizer = load(bare)
    with pytest.raises(
        UnsupportedSpeculativeMethod, match="mtp needs .* qwen3_5 checkpoint has none.*mtp_num_hidden_layers"
    ):
        Engine(model, tokenizer, EngineConfig(speculative=mtp_spec()))
    undeclared = make_tiny_hybrid_checkpoint(tmp_path / "undeclared", vision=False)
    add_mtp_layers(undeclared, declare=False)
    with pytest.raises(UnsupportedSpeculativeMethod, match="mtp_num_hidden_layers"):
        head_for(undeclared, load(undeclared)[0])
    empty = make_tiny_hybrid_checkpoint(tmp_path / "empty", vision=False)
    raw = json.loads((empty / "config.json").read_text())
    (empty / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="declares 1 multi-token-prediction layer.*no 'mtp.\\*' tensors"):
        head_for(empty, load(empty)[0])
    dense = make_tiny_checkpoint(tmp_path / "dense", "qwen3")
    model, tokenizer = load(dense)
    with pytest.raises(UnsupportedSpeculativeMethod, match="qwen3 checkpoint has none"):
        Engine(model, tokenizer, EngineConfig(speculative=mtp_spec()))
    nemotron = make_tiny_nemotron_h_checkpoint(tmp_path / "nemotron")  # config lists mtp_layers_block_type
    model, tokenizer = load(nemotron)
    with pytest.raises(UnsupportedSpeculativeMethod, match="nemotron_h checkpoint has none"):
        Engine(model, tokenizer, EngineConfig(speculative=mtp_spec()))
    with pytest.raises(SpeculativeConfigError, match="draft_top_k > 1 .*mtp needs model .*linear chains"):
        SpeculativeConfig(method="mtp", draft_top_k=2)


@pytest.mark.parametrize(
    "engine_process", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["in-process", "core-process"]
)
def test_llm_drafts_with_the_bundles_mtp_layers(tmp_path, prompts, engine_process):
    """LLM(speculative_config={"method": "mtp"}): the bundle keeps the checkpoint's mtp.* tensors and
    the engine (in this process or its own) loads them (only them) beside the model; output equals
    plain decoding. A checkpoint without them is refused before any weight loads."""
    from trtedge import LLM, ConfigError

    path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False)
    add_mtp_layers(path)
    kw = dict(max_kv_cache_capacity=256, max_input_len=128, max_batch_size=2, enable_in_flight_batching=True)
    with LLM(str(path), **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts[:2], GREEDY)]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(str(path), speculative_config=spec, engine_process=engine_process, **kw) as llm:
        outs = llm.generate(prompts[:2], GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert all(o.metrics.spec_draft_tokens > 0 for o in outs)
        assert llm.stats()["speculative"]["method"] == "mtp"
    bare = make_tiny_hybrid_checkpoint(tmp_path / "bare", vision=False)
    with pytest.raises(ConfigError, match="method mtp needs the checkpoint's multi-token-prediction layers"):
        LLM(str(bare), speculative_config=spec, **kw)


def test_random_weight_loads_draft_with_random_mtp_layers(tmp_path, prompts):
    """load_format dummy (measuring a model's shape): the MTP layer gets random weights of its layout
    too, and greedy output still equals the same random target's plain decoding."""
    from trtedge import LLM

    path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False, moe=True)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    kw = dict(load_format="dummy", max_kv_cache_capacity=256, max_input_len=128, engine_process=False)
    with LLM(str(path), **kw) as llm:
        expected = llm.generate(prompts[0], GREEDY).token_ids
    with LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kw) as llm:
        out = llm.generate(prompts[0], GREEDY)
    assert out.token_ids == expected and out.metrics.spec_draft_tokens > 0


def test_nemotron_h_mtp_module_drafts_as_its_reference_and_greedy_equals_plain(tmp_path, prompts):
    """Nemotron-H's MTP module (attention then MoE block, eh_proj fusion, final_layernorm): the chain
    drafted after the prefill equals the reference's, logits included; greedy output equals plain
    decoding alone and in a batch of 8, every block, slot and draft row freed."""
    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    tensors = add_nemotron_mtp_layers(path)
    model, tokenizer = load(path)
    head = head_for(path, model)
    reference = NemotronReference(path, tensors)
    engine = Engine(
        model, tokenizer, EngineConfig(max_kv_cache_capacity=256, speculative=mtp_spec(3)), draft=head
    )
    calls = []
    propose = engine.speculative.proposer.propose

    def recording(seqs, limits):
        drafts = propose(seqs, limits)
        calls.extend(
            (list(s.token_ids), d.tokens) for s, d in zip(seqs, host_drafts(drafts)) if d is not None
        )
        return drafts

    engine.speculative.proposer.propose = recording
    try:
        list(engine.submit(prompts[2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    finally:
        engine.shutdown()
    tokens, draft = calls[0]
    assert draft == reference.chain(tokens, len(draft))[0]
    plain, _ = generate(model, tokenizer, prompts, GREEDY, batch=8)
    outs, engine = generate(
        model, tokenizer, prompts, GREEDY, speculative=mtp_spec(2), draft=head_for(path, model), batch=8
    )
    assert outs == plain and engine.speculative.stats.draft_tokens > 0
    assert_nothing_leaked(engine)
    alone, engine = generate(
        model, tokenizer, prompts[:3], GREEDY, speculative=mtp_spec(2), draft=head_for(path, model), batch=1
    )
    assert alone == plain[:3]
    assert_nothing_leaked(engine)


def test_mtp_with_context_reuse_drafts_over_a_reused_prefix(mtp_model, prompts, plain):
    """A request whose prompt extends an earlier one's reuses its cached prefix (the target computes
    only the rest, so the MTP layer never sees hidden states for the reused positions): output still
    equals plain decoding and nothing leaks."""
    path, model, tokenizer, _, moe = mtp_model
    if moe:
        pytest.skip("the reuse path does not depend on the MLP kind")
    config = EngineConfig(max_kv_cache_capacity=256, enable_context_reuse=True, speculative=mtp_spec(2))
    engine = Engine(model, tokenizer, config, draft=head_for(path, model))
    long = prompts[3] * 2  # past one 16-token block: a prefix to reuse
    try:
        first = [t for d in engine.submit(long, GREEDY) for t in d.token_ids]
        metrics = []
        second = [
            t for d in engine.submit(long + first[:3], GREEDY, on_metrics=metrics.append) for t in d.token_ids
        ]
        assert metrics[0].reused_tokens > 0
    finally:
        engine.shutdown()
    assert_nothing_leaked(engine)
    cold, _ = generate(model, tokenizer, [long, long + first[:3]], GREEDY, batch=1)
    assert [first, second] == cold


def test_target_hiddens_keep_copies_of_a_reused_output_buffer():
    """A CUDA-graph step's hidden states are the graph's output buffer, rewritten by the next replay:
    the rows a proposer reads steps later are those of the step that produced them."""
    from trtedge.runtime.core.request import Sequence
    from trtedge.runtime.speculative.draft_cache import TargetHiddens

    cache = DraftCache(1, 2, 4, 8, 4, torch.float32, torch.device("cpu"))
    hiddens = TargetHiddens(cache, 3, torch.float32, torch.device("cpu"))
    seq = Sequence([5, 6, 7], GREEDY)
    buffer = torch.zeros(4, 3)
    for step in range(3):  # three one-token steps of the same seat, the buffer rewritten by each
        buffer.fill_(float(step + 1))
        seq.num_computed_tokens = 3 + step
        hiddens.observe([seq], [1], buffer)
    rows = hiddens.take(cache.state(seq), 2, 5)
    assert rows[:, 0].tolist() == [1.0, 2.0, 3.0]
