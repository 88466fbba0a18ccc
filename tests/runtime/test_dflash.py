"""DFlash speculative decoding: a tiny block-diffusion draft in the published layout (written here) drafts
what a straightforward torch reference drafts, block after block as the context grows; greedy output
equals plain decoding alone and in a batch of 8 with every KV block and draft row freed; bad drafts and
depths are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.dflash_tiny import Reference, write_dflash
from tests.runtime.spec_helpers import generate, host_drafts, load, repetitive_prompts
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, ConfigError, SamplingParams
from trtedge.runtime.speculative import SpeculativeConfig, SpeculativeConfigError
from trtedge.runtime.speculative.dflash import load_dflash

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = make_tiny_checkpoint(root / "t", "qwen3")
    write_dflash(root / "d")  # taps after layers 0 and 1 (the last: normed), block of 4
    return target, root / "d"


@pytest.fixture(scope="module")
def target(paths):
    return load(paths[0])


def _spec(draft, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="dflash", model=str(draft), num_speculative_tokens=k)


def test_dflash_drafts_equal_the_reference_block_after_block(paths, target):
    model, tokenizer = target
    reference = Reference(*paths)
    head = load_dflash(paths[1], model, 512, 3)
    seen = []

    from trtedge.runtime.speculative.dflash import DFlashProposer

    propose = DFlashProposer.propose

    def recording(self, seqs, limits):
        drafts = propose(self, seqs, limits)
        seen.extend(
            (list(seq.token_ids), draft.tokens if draft else None)
            for seq, draft in zip(seqs, host_drafts(drafts))
        )
        return drafts

    DFlashProposer.propose = recording
    try:
        prompts = repetitive_prompts(3, seed=2)
        outs, eng = generate(model, tokenizer, prompts, speculative=_spec(paths[1]), draft=head, batch=3)
    finally:
        DFlashProposer.propose = propose
        model.aux_layers = ()
    assert len(seen) >= 6 and all(d is not None for _, d in seen)
    for tokens, drafts in seen[::5]:  # every sequence, early and late blocks (the reference is slow)
        expected = reference.block_logits(tokens)
        assert drafts == expected.argmax(dim=-1).tolist()[: len(drafts)]
    # the logits themselves, for the last block seen
    tokens = seen[-1][0]
    try:
        logits = _head_logits(head, model, tokens)
    finally:
        model.aux_layers = ()
    torch.testing.assert_close(logits, reference.block_logits(tokens), rtol=1e-4, atol=1e-4)


def _head_logits(head, model, tokens) -> torch.Tensor:
    """The head's block logits after ``tokens`` in a fresh cache, from trtedge's target taps."""
    from trtedge.runtime.ops.attention import AttentionBatch
    from trtedge.runtime.speculative.draft_cache import DraftCache, DraftState

    n, bs = len(tokens), head.block_size
    model.aux_layers = head.taps
    shape = (8, 16, model.cfg.num_kv_heads, model.cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    attn = AttentionBatch(torch.arange(n - 1), [n - 1], [n - 1], [torch.arange(8)], 16)
    model.forward(torch.tensor(tokens[:-1]), torch.arange(n - 1), kv, attn)
    cache = DraftCache(
        head.num_kv_layers, head.num_kv_heads, head.head_dim, 8, 16, torch.float32, model.device
    )
    st = DraftState()
    cache.reserve(st, n - 1 + bs)
    ids = torch.tensor([tokens[-1]] + [head.mask_token_id] * (bs - 1))
    positions = torch.arange(n - 1 + bs)  # the context rows', then the block's
    batch = head.block_batch([(st.block_table, 0, n - 1)], 16)
    logits = head.forward(head.features(model.aux_hidden), ids, positions, cache.kv_caches, batch)
    return logits[1:]


@pytest.mark.parametrize("batch", [1, 8], ids=["alone", "batch-of-8"])
def test_dflash_greedy_equals_plain_greedy_and_frees_everything(paths, target, batch):
    model, tokenizer = target
    prompts = repetitive_prompts(8, seed=6)
    plain, _ = generate(model, tokenizer, prompts, batch=batch)
    head = load_dflash(paths[1], model, 512, 3)
    try:
        outs, eng = generate(model, tokenizer, prompts, speculative=_spec(paths[1]), draft=head, batch=batch)
    finally:
        model.aux_layers = ()
    assert outs == plain
    spec = eng.speculative
    assert spec.stats.steps > 0 and spec.stats.draft_tokens > 0
    cache = spec.proposer.cache
    assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "core-process"])
def test_llm_serves_dflash_and_refuses_a_depth_past_the_block(paths, engine_process):
    target, draft = paths
    prompt = repetitive_prompts(1, seed=4)[0]
    kw = dict(max_kv_cache_capacity=256, max_input_len=128)
    with LLM(str(target), **kw) as plain:
        expected = plain.generate(prompt, GREEDY).token_ids
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    with LLM(str(target), speculative_config=spec, engine_process=engine_process, **kw) as llm:
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == expected and out.metrics.spec_steps > 0
    if engine_process:
        return
    with pytest.raises(
        ConfigError, match=r"num_speculative_tokens \(4\) must not exceed .* block_size - 1 \(3\)"
    ):
        LLM(str(target), speculative_config={**spec, "num_speculative_tokens": 4}, **kw)
    # the default depth (15, a block of 16) does not fit this block of 4 either
    with pytest.raises(ConfigError, match=r"num_speculative_tokens \(15\)"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(draft)}, **kw)


def test_bad_dflash_drafts_are_refused_naming_the_key(paths, target, tmp_path):
    model, _ = target
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens"):
        load_dflash(paths[1], model, 512, 7)
    config = json.loads((paths[1] / "config.json").read_text())
    for change, message in (
        ({"target_layer_ids": [0, 5]}, "target_layer_ids"),
        ({"mask_token_id": 4096}, "mask_token_id"),
        ({"block_size": 1}, "block_size"),
    ):
        bad = tmp_path / message
        bad.mkdir()
        (bad / "model.safetensors").symlink_to(paths[1] / "model.safetensors")
        (bad / "config.json").write_text(
            json.dumps(config | {"dflash_config": config["dflash_config"] | change})
        )
        with pytest.raises(ValueError, match=message):
            load_dflash(bad, model, 512, 1)
    with pytest.raises(SpeculativeConfigError, match="method dflash needs model"):
        SpeculativeConfig(method="dflash")


def test_draft_tree_takes_the_best_scored_paths_first_children_the_best_tokens():
    import itertools

    from trtedge.runtime.speculative.dflash import draft_tree

    torch.manual_seed(0)
    depth, top_k, budget = 4, 3, 11
    logprobs = torch.log_softmax(torch.randn(depth, 8), dim=-1).topk(top_k, dim=-1)
    values, tokens = logprobs.values, logprobs.indices + 100 * torch.arange(depth)[:, None]
    tree = draft_tree(values, tokens, budget)
    assert len(tree) == budget and all(p <= j for j, p in enumerate(tree.parents))

    def path(node):  # the token path from the root to ``node``
        out = []
        while node:
            out.append(tree.tokens[node - 1])
            node = tree.parents[node - 1]
        return tuple(reversed(out))

    scores = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(top_k), repeat=d):
            scores[tuple(int(tokens[i, r]) for i, r in enumerate(ranks))] = sum(
                float(values[i, r]) for i, r in enumerate(ranks)
            )
    best = sorted(scores, key=scores.get, reverse=True)[:budget]
    assert {path(n) for n in range(1, budget + 1)} == set(best)
    assert tree.first_path().tokens == tokens[:, 0].tolist()[: len(tree.first_path())]


def test_dflash_token_trees_for_greedy_requests_chains_for_sampled_ones(paths, target):
    model, tokenizer = target
    prompts = repetitive_prompts(8, seed=6)
    plain, _ = generate(model, tokenizer, prompts, batch=8)
    head = load_dflash(paths[1], model, 512, 3)
    spec = SpeculativeConfig(method="dflash", model=str(paths[1]), num_speculative_tokens=3, draft_top_k=3)
    assert spec.verify_tokens == 9

    from trtedge.runtime.speculative.dflash import DFlashProposer

    propose, seen = DFlashProposer.propose, []

    def recording(self, seqs, limits):
        drafts = propose(self, seqs, limits)
        seen.extend((seq.params.greedy, d) for seq, d in zip(seqs, host_drafts(drafts)) if d is not None)
        return drafts

    DFlashProposer.propose = recording
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    try:
        outs, eng = generate(model, tokenizer, prompts, speculative=spec, draft=head, batch=8)
        mixed, _ = generate(
            model, tokenizer, prompts[:2], [GREEDY, sampled], speculative=spec, draft=head, batch=2
        )
    finally:
        DFlashProposer.propose = propose
        model.aux_layers = ()
    assert outs == plain and mixed[0] == plain[0][:16] and len(mixed[1]) == 16
    assert any(greedy and not d.is_chain for greedy, d in seen)
    assert all(d.is_chain for greedy, d in seen if not greedy) and any(not g for g, _ in seen)
    cache = eng.speculative.proposer.cache
    assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
    with pytest.raises(SpeculativeConfigError, match="draft_top_k > 1 .* needs method eagle3, dflash or mtp"):
        SpeculativeConfig(method="ngram", draft_top_k=2)


def test_dflash_with_context_reuse_drafts_over_a_reused_prefix(paths, target):
    """A prompt extending an earlier one reuses its cached prefix, whose target hidden states the draft
    never saw (it reads zeros there): output still equals plain decoding and nothing leaks."""
    from trtedge.runtime.engine import Engine, EngineConfig

    model, tokenizer = target
    head = load_dflash(paths[1], model, 512, 3)
    config = EngineConfig(max_kv_cache_capacity=256, enable_context_reuse=True, speculative=_spec(paths[1]))
    engine = Engine(model, tokenizer, config, draft=head)
    long = repetitive_prompts(4, seed=8)[3] * 2  # past one 16-token block: a prefix to reuse
    try:
        first = [t for d in engine.submit(long, GREEDY) for t in d.token_ids]
        metrics = []
        second = [
            t for d in engine.submit(long + first[:3], GREEDY, on_metrics=metrics.append) for t in d.token_ids
        ]
        assert metrics[0].reused_tokens > 0 and metrics[0].spec_steps > 0
    finally:
        engine.shutdown()
        model.aux_layers = ()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    cache = engine.speculative.proposer.cache
    assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
    cold, _ = generate(model, tokenizer, [long, long + first[:3]], GREEDY, batch=1)
    assert [first, second] == cold
