"""Gemma 4's assistant drafter ({"method": "mtp", "model": <assistant>}) on a tiny random Gemma 4 target:
every proposal's drafts and step logits equal transformers' Gemma4AssistantForCausalLM driven as its
candidate generator drives it (past the sliding window, after partly accepted drafts, with the
centroid-masked logits too); greedy output equals plain decoding alone and in a batch of 8, as chains
and as token trees, with every block and hidden row freed; bad configurations are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.gemma4_assistant_tiny import AssistantReference, make_tiny_assistant
from tests.runtime.spec_helpers import generate, load
from tests.tiny import PLE_VOCAB, make_tiny_checkpoint, make_tiny_ple_checkpoint
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative import (
    SpeculativeConfig,
    SpeculativeConfigError,
    UnsupportedSpeculativeMethod,
)
from trtedge.runtime.speculative.gemma4_assistant import load_assistant
from trtedge.runtime.speculative.tree import Draft

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_ple_checkpoint(tmp_path_factory.mktemp("gemma4") / "t", "gemma4")
    model, tokenizer = load(path)
    return path, model, tokenizer


@pytest.fixture(scope="module", params=[False, True], ids=["lm-head", "ordered-embeddings"])
def assistant(request, tmp_path_factory):
    return make_tiny_assistant(tmp_path_factory.mktemp("assistant") / "a", ordered=request.param)


def prompts(count: int = 8, length: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, PLE_VOCAB, (length + i,), generator=g).tolist() for i in range(count)]


def spec(path, k: int = 3, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", model=str(path), num_speculative_tokens=k, **kw)


@pytest.fixture(scope="module")
def plain(target):
    _, model, tokenizer = target
    return generate(model, tokenizer, prompts(), GREEDY)[0]


def assert_nothing_leaked(engine) -> None:
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.speculative.proposer.rows  # one hidden row per live sequence, dropped with it


def test_assistant_drafts_and_logits_match_transformers(target, assistant, plain):
    """Each proposal (the first after the prompt, later ones after 2 of 3 drafts were accepted) against
    the reference recomputed from the sequence's tokens: the kept target row must be the right one."""
    path, model, tokenizer = target
    reference = AssistantReference(path, assistant)
    prompt, answer = prompts(1, 20)[0], plain[0]
    engine = Engine(model, tokenizer, EngineConfig(max_kv_cache_capacity=256, speculative=spec(assistant)),
                    draft=load_assistant(assistant, model, 256))  # fmt: skip
    proposer = engine.speculative.proposer
    step, seen, logits = proposer.head.step, [], []

    def recording_step(*args):
        out = step(*args)
        logits.append(out[0][0].clone())
        return out

    def propose(seqs, limits):
        logits.clear()
        drafts = type(proposer).propose(proposer, seqs, limits)
        seq = seqs[0]
        seen.append((list(seq.token_ids), drafts[0].tokens, torch.stack(logits)))
        made = len(seq.token_ids) - len(prompt)
        right = answer[made : made + 2]  # the target's next two tokens, then a wrong third
        return [Draft.chain(right + [(answer[made + 2] + 1) % PLE_VOCAB])] if len(right) == 2 else drafts

    proposer.head.step, proposer.propose = recording_step, propose
    try:
        out = [t for d in engine.submit(prompt, GREEDY) for t in d.token_ids]
    finally:
        engine.shutdown()
    assert out == answer
    assert len(seen) >= 4 and engine.speculative.stats.accepted_tokens > 0
    for tokens, drafts, step_logits in seen:
        expected, expected_logits = reference.drafts(tokens, len(drafts))
        assert drafts == expected
        torch.testing.assert_close(step_logits[: len(drafts)], expected_logits, rtol=1e-4, atol=1e-4)
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("batch", [1, 8], ids=["alone", "batch-of-8"])
@pytest.mark.parametrize("top_k", [1, 2], ids=["chain", "tree"])
def test_assistant_greedy_equals_plain_and_frees_everything(target, assistant, plain, batch, top_k):
    _, model, tokenizer = target
    config = spec(assistant, 3, draft_top_k=top_k)
    draft = load_assistant(assistant, model, 256)
    outs, engine = generate(model, tokenizer, prompts(), GREEDY, speculative=config, draft=draft, batch=batch)
    assert outs == plain
    stats = engine.speculative.stats
    assert (
        stats.steps > 0 and stats.draft_tokens >= (2 if top_k == 1 else 4) * stats.steps
    )  # shorter near the end
    assert_nothing_leaked(engine)


def test_a_tree_keeps_the_top_k_first_tokens_of_the_reference(target, assistant):
    path, model, tokenizer = target
    reference = AssistantReference(path, assistant)
    engine = Engine(model, tokenizer, EngineConfig(max_kv_cache_capacity=256, speculative=spec(assistant, 3, draft_top_k=2)),
                    draft=load_assistant(assistant, model, 256))  # fmt: skip
    proposer, seen = engine.speculative.proposer, []
    propose = proposer.propose
    proposer.propose = lambda seqs, limits: (
        seen.append((list(seqs[0].token_ids), propose(seqs, limits)[0])) or [seen[-1][1]]
    )
    try:
        list(engine.submit(prompts(1)[0], GREEDY))
    finally:
        engine.shutdown()
    tokens, tree = seen[0]
    _, logits = reference.drafts(tokens, 1)
    roots = [tree.tokens[c - 1] for c in tree.children()[0]]
    assert roots == logits[0].topk(2).indices.tolist()
    assert len(tree) == 10 and not tree.is_chain  # every node: 2 + 2 x 2 x 2 (verify_tokens 60)
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("top_k", [1, 2], ids=["chain", "tree"])
def test_sampled_requests_and_opt_outs_share_a_batch(target, assistant, plain, top_k):
    """Seeded sampled requests beside greedy ones and ones with disable_spec_decode: greedy ones equal
    plain decoding, opted-out ones get no drafts and keep no row, a second round repeats the first."""
    _, model, tokenizer = target
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, disable_spec_decode=i % 3 == 1)
        for i in range(8)
    ]
    draft = load_assistant(assistant, model, 256)
    outs, engine = generate(
        model,
        tokenizer,
        prompts(),
        params,
        speculative=spec(assistant, 2, draft_top_k=top_k),
        draft=draft,
        rounds=2,
    )
    assert outs[:8] == outs[8:]
    assert [outs[i] for i in range(8) if i % 3] == [plain[i][:12] for i in range(8) if i % 3]
    assert_nothing_leaked(engine)


def test_bad_assistants_are_refused_naming_the_key(tmp_path, target, assistant):
    path, model, tokenizer = target
    with pytest.raises(SpeculativeConfigError, match="draft_top_k > 1 .* method mtp needs model"):
        SpeculativeConfig(method="mtp", draft_top_k=2)
    other = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    with pytest.raises(
        UnsupportedSpeculativeMethod, match="--speculative-config model: .*model_type gemma4_assistant"
    ):
        load_assistant(other, model, 256)
    with pytest.raises(
        UnsupportedSpeculativeMethod, match="drafts for Gemma 4 targets, and this target is qwen3"
    ):
        load_assistant(assistant, load(other)[0], 256)
    wide = tmp_path / "wide"
    wide.mkdir()
    raw = json.loads((assistant / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**raw, "backbone_hidden_size": 128}))
    with pytest.raises(
        UnsupportedSpeculativeMethod,
        match="backbone_hidden_size \\(128\\) is not the target's hidden size \\(64\\)",
    ):
        load_assistant(wide, model, 256)


@pytest.mark.parametrize(
    "engine_process", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["in-process", "core-process"]
)
def test_llm_drafts_with_an_assistant_directory(target, assistant, plain, engine_process, tmp_path):
    from trtedge import LLM, ConfigError

    path = target[0]
    kw = dict(dtype="float32", device="cpu", max_kv_cache_capacity=256, max_input_len=128, max_batch_size=2,
              enable_in_flight_batching=True, engine_process=engine_process)  # fmt: skip
    config = {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 2}
    with LLM(str(path), speculative_config=config, **kw) as llm:
        outs = llm.generate(prompts()[:2], GREEDY)
        assert [o.token_ids for o in outs] == plain[:2]
        assert all(o.metrics.spec_draft_tokens > 0 for o in outs)
    other = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    with pytest.raises(ConfigError, match="model_type gemma4_assistant"):
        LLM(str(path), speculative_config={**config, "model": str(other)}, **kw)


def test_assistant_with_context_reuse_drafts_over_a_reused_prefix(target, assistant):
    """A prompt extending an earlier one reuses its cached blocks (the target computes only the rest):
    the assistant reads the reused keys from the target's cache, and output equals a cold run."""
    _, model, tokenizer = target
    long = prompts(1, 40)[0]
    config = EngineConfig(
        max_kv_cache_capacity=256, enable_context_reuse=True, speculative=spec(assistant, 2)
    )
    engine = Engine(model, tokenizer, config, draft=load_assistant(assistant, model, 256))
    try:
        first = [t for d in engine.submit(long, GREEDY) for t in d.token_ids]
        metrics = []
        again = long + first[:3]
        second = [t for d in engine.submit(again, GREEDY, on_metrics=metrics.append) for t in d.token_ids]
        assert metrics[0].reused_tokens > 0 and metrics[0].spec_draft_tokens > 0
    finally:
        engine.shutdown()
    assert_nothing_leaked(engine)
    cold, _ = generate(model, tokenizer, [long, again], GREEDY, batch=1)
    assert [first, second] == cold


def test_the_token_ordering_stays_exact_in_a_bf16_head(target, tmp_path):
    """The centroid table's token ids are integers: a bf16 head (CUDA's activations) must not round
    them (bf16 holds integers exactly only up to 256)."""
    from safetensors import safe_open

    _, model, _ = target
    ordered = make_tiny_assistant(tmp_path / "a", ordered=True)
    with safe_open(str(ordered / "model.safetensors"), "pt") as f:
        expected = f.get_tensor("masked_embedding.token_ordering")
    act_dtype = model.act_dtype
    model.act_dtype = torch.bfloat16  # what a CUDA bf16 target runs in
    try:
        head = load_assistant(ordered, model, 256)
    finally:
        model.act_dtype = act_dtype
    assert head.ordering.dtype == torch.long and torch.equal(head.ordering, expected)
