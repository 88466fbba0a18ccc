"""Speculative decoding: config validation, n-gram lookup, linear and tree verification in the
engine (greedy output identical to plain decoding, KV rolled back), and exactness of the sampler."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.spec_helpers import generate, host_drafts, load, repetitive_prompts
from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative import SpeculativeConfig, SpeculativeConfigError
from trtedge.runtime.speculative.ngram import lookup
from trtedge.runtime.speculative.tree import DeviceChains, Draft
from trtedge.runtime.speculative.verifier import accept_greedy, accept_sampled


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load(make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "t", "qwen3"))


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "ngram", "k": 1}, "unknown key.*k"),
        ({"method": "draft_model"}, "needs model"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "needs model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "verify_tokens": -1}, "verify_tokens"),
        ({"method": "eagle3", "model": "x", "draft_top_k": 0}, "draft_top_k"),
        ({"method": "ngram", "draft_top_k": 2}, "draft_top_k"),
        ({"method": "medusa"}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "needs method"),
        ('{"method": ', "not valid JSON"),
    ],
)
def test_config_errors_name_the_key(value, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        SpeculativeConfig.coerce(value)


def test_config_defaults_and_json():
    config = SpeculativeConfig.coerce('{"method": "eagle3", "model": "d", "draft_top_k": 4}')
    assert (config.num_speculative_tokens, config.verify_tokens, config.is_tree) == (
        4,
        60,
        True,
    )  # the reference's
    dflash = SpeculativeConfig.coerce(
        {"method": "dflash", "model": "d", "num_speculative_tokens": 4, "draft_top_k": 2}
    )
    assert dflash.verify_tokens == 8 and SpeculativeConfig("mtp", num_speculative_tokens=3).verify_tokens == 3
    assert SpeculativeConfig.coerce(None) is None
    assert config.replace(num_speculative_tokens=2, verify_tokens=None).num_speculative_tokens == 2


def test_ngram_lookup_prefers_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(tokens, 3, 1, 4) == [7, 8, 5]  # "2 3" last followed by 7 8 5 ... ("1 2 3" absent at end)
    assert lookup([4, 5, 6], 2, 1, 3) == []


def test_tree_masks_and_depths():
    draft = Draft([10, 11, 12, 13], [0, 0, 1, 2])
    assert draft.depths() == [0, 1, 1, 2, 2]
    mask = draft.ancestor_mask()
    assert mask[3].tolist() == [True, True, False, True, False]
    assert mask[4].tolist() == [True, False, True, False, True]
    assert not draft.is_chain and Draft.chain([1, 2]).is_chain


def test_greedy_acceptance_walks_the_tree():
    draft = Draft([5, 6, 7, 8], [0, 0, 2, 3])  # root -> {5, 6}; 6 -> 7 -> 8
    target = [6, 0, 7, 9, 0]  # argmax after each node
    verdict = accept_greedy(target, draft)
    assert verdict.path == [2, 3] and verdict.tokens == [6, 7, 9]


def test_ngram_greedy_matches_plain_alone_and_in_batch_of_8(target):
    model, tok = target
    prompts = repetitive_prompts(8)
    plain, _ = generate(model, tok, prompts)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    batched, eng = generate(model, tok, prompts, speculative=spec)
    assert batched == plain
    stats = eng.speculative.stats
    assert stats.steps > 0 and stats.accepted_tokens > 0
    alone, _ = generate(model, tok, prompts[:1], speculative=spec, batch=1)
    assert alone == plain[:1]


class OracleTree:
    """Proposes a tree whose first child at every level is wrong and whose second child continues the
    known greedy output: verification must take the second branch and move its KV."""

    def __init__(self, references: dict[tuple, list[int]], depth: int):
        self.references = references
        self.depth = depth

    def propose(self, seqs, limits):
        drafts = []
        for seq, limit in zip(seqs, limits):
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            ref = self.references[prompt]
            done = seq.num_output_tokens
            follow = ref[done : done + min(limit, self.depth)]
            tokens, parents, node = [], [], 0
            for i, token in enumerate(follow):
                wrong = (token + 1) % 500 + 3
                tokens += [wrong, token if i != 2 else wrong + 1]  # level 3 has no right answer
                parents += [node, node]
                node = len(tokens)
                if i == 2:
                    break
            drafts.append(Draft(tokens, parents) if tokens else None)
        return drafts

    def verified(self, seq, draft, path, aux):
        pass

    def observe(self, seqs, num_tokens, aux):
        pass

    def release(self, seq):
        pass


def test_tree_verification_matches_plain_and_rolls_back(target):
    model, tok = target
    prompts = repetitive_prompts(8, seed=1)
    plain, _ = generate(model, tok, prompts)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, verify_tokens=8)
    from trtedge.runtime.engine import Engine

    original = Engine.__init__

    def patched(self, *a, **kw):
        original(self, *a, **kw)
        self.speculative.proposer = OracleTree({tuple(p): o for p, o in zip(prompts, plain)}, 4)

    Engine.__init__ = patched
    try:
        tree, eng = generate(model, tok, prompts, speculative=spec)
    finally:
        Engine.__init__ = original
    assert tree == plain
    stats = eng.speculative.stats
    assert stats.accepted_tokens >= 2 * stats.steps - 8  # two right answers per step (bar the end)


def test_a_proposers_bookkeeping_after_verification_counts_as_proposal_time(target):
    """The verify span is the target's forward and the acceptance: what a proposer does with the
    verdict (a head keeps the accepted rows' hidden states) is drafting work."""
    import time

    from trtedge.runtime.engine import Engine
    from trtedge.runtime.speculative.ngram import NgramProposer

    class SlowBookkeeping(NgramProposer):
        def verified(self, seq, draft, path, aux):
            time.sleep(0.02)

    model, tok = target
    prompts = repetitive_prompts(1)
    plain, _ = generate(model, tok, prompts)
    original = Engine.__init__

    def patched(self, *a, **kw):
        original(self, *a, **kw)
        self.speculative.proposer = SlowBookkeeping()

    Engine.__init__ = patched
    try:
        outs, eng = generate(model, tok, prompts, speculative=SpeculativeConfig("ngram"))
    finally:
        Engine.__init__ = original
    stats = eng.speculative.stats
    assert outs == plain and stats.steps > 0
    assert stats.proposal_time >= 0.02 * stats.steps
    assert stats.verification_time < stats.proposal_time


def test_disable_spec_decode_and_penalties_take_the_plain_path(target):
    model, tok = target
    prompts = repetitive_prompts(2)
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, disable_spec_decode=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3),
    ]
    plain, _ = generate(model, tok, prompts, params)
    outs, eng = generate(model, tok, prompts, params, speculative=SpeculativeConfig("ngram"))
    assert outs == plain and eng.speculative.stats.steps == 0


def test_context_reuse_with_speculation(target):
    model, tok = target
    prompts = repetitive_prompts(4, seed=2)
    shared = [prompts[0] * 3 + p for p in prompts]  # a 48+ token shared prefix: full blocks reused
    plain, _ = generate(model, tok, shared)
    spec = SpeculativeConfig("ngram")
    outs, eng = generate(model, tok, shared, speculative=spec, rounds=2, enable_context_reuse=True)
    assert outs == plain + plain and eng.blocks.stats.reused_tokens > 0


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("draft", [Draft.chain([2, 0]), Draft([2, 5, 0, 1], [0, 0, 1, 2])])
def test_rejection_sampling_preserves_the_target_distribution(draft):
    """Chi-square of the first two emitted tokens against the target's own joint distribution."""
    torch.manual_seed(0)
    vocab, samples = 6, 6000
    probs = torch.softmax(torch.randn(len(draft) + 1, vocab) * 1.5, dim=-1)
    depth = draft.depths()
    kids = draft.children()

    # the target's next-token distribution after emitting token t at the root: the matching child's node
    # if the draft has that child, else no draft information (any distribution: take node 0's)
    def after(token):
        child = next((c for c in kids[0] if draft.tokens[c - 1] == token), None)
        return probs[child] if child is not None else probs[0]

    joint = torch.stack([probs[0][a] * after(a) for a in range(vocab)])  # [first, second]
    counts = torch.zeros(vocab, vocab)
    for seed in range(samples):
        verdict = accept_sampled(probs, draft, seed, 100)
        tokens = verdict.tokens
        if len(tokens) < 2:  # rejected at the root: the second token would come from a later step
            second_probs = after(tokens[0])
            second = int(torch.multinomial(second_probs, 1, generator=torch.Generator().manual_seed(seed)))
            tokens = tokens + [second]
        counts[tokens[0], tokens[1]] += 1
    stat, dof = _chi_square(counts.flatten(), joint.flatten())
    assert dof > 5
    # 99.9% quantile of chi-square with dof degrees of freedom (Wilson-Hilferty)
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert stat < limit, (stat, limit, dof)
    assert depth[-1] >= 1


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return load(make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "d", "llama", seed=7))[0]


def test_draft_model_greedy_matches_plain_alone_and_in_batch_of_8(target, random_draft):
    model, tok = target
    prompts = repetitive_prompts(8, seed=3)
    plain, _ = generate(model, tok, prompts)
    spec = SpeculativeConfig("draft_model", model="tiny-draft", num_speculative_tokens=3)
    batched, eng = generate(model, tok, prompts, speculative=spec, draft=random_draft)
    assert batched == plain
    assert eng.speculative.stats.steps > 0
    assert not eng.speculative.proposer.cache.states  # released with their sequences
    alone, _ = generate(model, tok, prompts[:1], speculative=spec, draft=random_draft, batch=1)
    assert alone == plain[:1]


def test_draft_equal_to_target_accepts_everything(tmp_path_factory, target):
    model, tok = target
    twin = load(make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "t", "qwen3"))[0]  # same weights
    prompts = repetitive_prompts(4, seed=4)
    plain, _ = generate(model, tok, prompts)
    spec = SpeculativeConfig("draft_model", model="twin", num_speculative_tokens=4)
    outs, eng = generate(model, tok, prompts, speculative=spec, draft=twin)
    stats = eng.speculative.stats
    assert outs == plain
    assert stats.acceptance_rate > 0.95, stats
    assert stats.mean_accepted_length > 4.5


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, target):
    from tests.runtime.eagle3_tiny import make_eagle3_head

    model, _ = target
    return make_eagle3_head(
        tmp_path_factory.mktemp("spec") / "e", model.cfg.hidden_size, model.cfg.vocab_size
    )


@pytest.mark.parametrize("top_k", [1, 3])
def test_eagle3_random_head_greedy_matches_plain_alone_and_in_batch_of_8(target, eagle_dir, top_k):
    from trtedge.runtime.speculative.eagle3 import load_eagle3

    model, tok = target
    prompts = repetitive_prompts(8, seed=5)
    plain, _ = generate(model, tok, prompts)
    head = load_eagle3(eagle_dir, model)
    spec = SpeculativeConfig("eagle3", model=str(eagle_dir), num_speculative_tokens=3, draft_top_k=top_k)
    try:
        batched, eng = generate(model, tok, prompts, speculative=spec, draft=head)
        assert batched == plain
        stats = eng.speculative.stats
        assert stats.steps > 0 and stats.draft_tokens > stats.steps * (2 if top_k == 1 else 3)
        alone, _ = generate(model, tok, prompts[:1], speculative=spec, draft=head, batch=1)
        assert alone == plain[:1]
    finally:
        model.aux_layers, model.aux_hidden = (), None


def test_eagle3_device_chains_are_the_host_paths_chains(target, eagle_dir, monkeypatch):
    """Chains drafted on the device (read back with the verdict) are the chains of the host path, step
    after step of a batch of 8 whose rows reach their ends at different steps; outputs equal plain
    decoding and the draft cache is freed."""
    from trtedge.runtime.speculative.eagle3 import Eagle3Proposer, load_eagle3

    model, tok = target
    prompts = repetitive_prompts(8, seed=7)
    plain, _ = generate(model, tok, prompts)
    spec = SpeculativeConfig("eagle3", model=str(eagle_dir), num_speculative_tokens=3)
    propose, seen = Eagle3Proposer.propose, {True: [], False: []}
    for on_device in (True, False):

        def recording(self, seqs, limits, on_device=on_device):
            self.device_chains = on_device
            drafts = propose(self, seqs, limits)
            assert isinstance(drafts, DeviceChains) == on_device
            seen[on_device].append([(list(s.token_ids), d) for s, d in zip(seqs, host_drafts(drafts))])
            return drafts

        monkeypatch.setattr(Eagle3Proposer, "propose", recording)
        try:
            outs, eng = generate(model, tok, prompts, speculative=spec, draft=load_eagle3(eagle_dir, model))
        finally:
            model.aux_layers, model.aux_hidden = (), None
        assert outs == plain
        cache = eng.speculative.proposer.cache
        assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
    assert seen[True] == seen[False] and len(seen[True]) > 3
    assert len({len(d) for step in seen[True] for _, d in step if d is not None}) > 1  # short chains too


def test_device_chains_read_before_the_verify_give_the_same_output(target, eagle_dir, monkeypatch):
    """A decoder that reads device chains back before the verify forward (tensor parallelism does:
    the other ranks take host ids) decodes as plain decoding does."""
    from trtedge.runtime.speculative.decoder import SpeculativeDecoder
    from trtedge.runtime.speculative.eagle3 import load_eagle3

    model, tok = target
    prompts = repetitive_prompts(4, seed=8)
    plain, _ = generate(model, tok, prompts)
    init = SpeculativeDecoder.__init__

    def reading_first(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_drafts = False

    monkeypatch.setattr(SpeculativeDecoder, "__init__", reading_first)
    spec = SpeculativeConfig("eagle3", model=str(eagle_dir), num_speculative_tokens=3)
    try:
        outs, eng = generate(model, tok, prompts, speculative=spec, draft=load_eagle3(eagle_dir, model))
    finally:
        model.aux_layers, model.aux_hidden = (), None
    assert outs == plain and not eng.speculative.device_drafts and eng.speculative.stats.steps > 0


def test_device_chains_from_steps_keep_each_rows_tokens():
    steps = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10])]
    chains = DeviceChains.from_steps(steps, [[0, 1, 2], [0, 2], [2]], live=[0, 2, 3], num_seqs=4)
    assert chains.rows == [0, None, 1, 2] and chains.lengths == [2, 0, 1, 3]
    assert chains.to_host() == [Draft.chain([5, 8]), None, Draft.chain([6]), Draft.chain([7, 9, 10])]


def test_eagle3_layout_is_checked(tmp_path, target):
    from tests.runtime.eagle3_tiny import make_eagle3_head
    from trtedge.runtime.speculative.eagle3 import load_eagle3

    model, _ = target
    path = make_eagle3_head(tmp_path / "bad", model.cfg.hidden_size + 8, model.cfg.vocab_size)
    with pytest.raises(ValueError, match="fc.weight"):
        load_eagle3(path, model)


def test_eagle3_over_an_int8_target_reads_its_quantized_embeddings(tmp_path):
    """A target whose embeddings are quantized (--weights int8): the head embeds the draft's tokens
    through the same lookup the target uses, and greedy output still equals plain decoding."""
    from tests.runtime.eagle3_tiny import make_eagle3_head
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    from trtedge.runtime.ops.linear import QuantizedTensor
    from trtedge.runtime.speculative.eagle3 import load_eagle3

    path = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    checkpoint = resolve_checkpoint(str(path))
    model = load_model(checkpoint, dtype="float32", device="cpu", weights="int8", max_positions=512)
    tok = checkpoint.load_tokenizer()
    assert isinstance(model.embed, QuantizedTensor)
    eagle = make_eagle3_head(tmp_path / "e", model.cfg.hidden_size, model.cfg.vocab_size)
    prompts = repetitive_prompts(4, seed=2)
    plain, _ = generate(model, tok, prompts)
    spec = SpeculativeConfig("eagle3", model=str(eagle), num_speculative_tokens=3)
    try:
        out, eng = generate(model, tok, prompts, speculative=spec, draft=load_eagle3(eagle, model))
        assert out == plain and eng.speculative.stats.steps > 0
    finally:
        model.aux_layers, model.aux_hidden = (), None
