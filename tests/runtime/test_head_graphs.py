"""A draft head's chains through its CUDA graphs' steps (``speculative/head_graphs.py``: MTP layers
and EAGLE-3 heads, DFlash blocks): on the CPU the same steps run eagerly over the same static buffers
(the staged copy, the block tables kept per seat, the first step as one decode row per token, the
chain's slots computed from the tables; a block's padded context rows). The chains they draft equal
the eager proposer's, proposal after proposal of a batch of 8 whose requests
end at different steps (so chains are cut short); outputs equal plain decoding; nothing is leaked."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.spec_helpers import generate, head_checkpoint, host_drafts, load, repetitive_prompts
from trtedge.runtime import speculative
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.ops.attention import AttentionBatch, TorchAttention
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative import SpeculativeConfig
from trtedge.runtime.speculative.head_graphs import CaptureFailed, HeadGraphSpec

pytest.importorskip("transformers")

MAX_ROWS = 16  # a prompt's whole catch-up after its prefill is longer: that proposal runs eagerly


def _eager_graphs(rows: int):
    def spec(runner, depth, capacity, block_size):
        return HeadGraphSpec(depth, rows, -(-(capacity + depth) // block_size), capture=False)

    return spec


CAPACITY = 256  # the engines' max_kv_cache_capacity (spec_helpers.generate)


def _setup(tmp_path, family, k, max_positions):
    """(target, tokenizer, speculative config, a loader of the draft) for ``family``."""
    from trtedge.runtime.speculative.dflash import load_dflash
    from trtedge.runtime.speculative.eagle3 import load_eagle3
    from trtedge.runtime.speculative.mtp import load_mtp

    path, draft = head_checkpoint(tmp_path, family)
    model, tokenizer = load(path, max_positions)
    if family == "eagle3":
        spec = SpeculativeConfig("eagle3", model=str(draft), num_speculative_tokens=k)
        return model, tokenizer, spec, lambda: load_eagle3(draft, model, max_positions)
    if family == "dflash":
        k = min(k, 3)  # a block of 4
        spec = SpeculativeConfig("dflash", model=str(draft), num_speculative_tokens=k)
        return model, tokenizer, spec, lambda: load_dflash(draft, model, max_positions, k)
    spec = SpeculativeConfig("mtp", num_speculative_tokens=k)
    return model, tokenizer, spec, lambda: load_mtp(resolve_checkpoint(str(path)), model)


def _largest_catch_up(graphs) -> list[int]:
    """Wraps ``graphs.propose``: the list it returns fills with each proposal's largest catch-up (rows a
    sequence brings to its first step, or context rows to its block)."""
    seen, propose = [], graphs.propose

    def recording(rows, taps, *args):
        sizes = [len(r.ids) for r in rows] if hasattr(rows[0], "ids") else [t.shape[0] for t in taps]
        seen.append(max(sizes))
        return propose(rows, taps, *args)

    graphs.propose = recording
    return seen


CASES = {
    # requests ending at different steps, so chains are cut short
    "mixed-ends": dict(k=3, every=1, prompts=8, prompt_len=None, max_tokens=lambda i: 24 - 3 * (i % 4)),
    # drafting only every third token: a proposal catches up several tokens (as after accepted drafts)
    "catch-up": dict(k=3, every=3, prompts=8, prompt_len=None, max_tokens=lambda i: 24 - 3 * (i % 4)),
    # requests running into the KV capacity, the rotary tables exactly that long: a chain's tokens a
    # request may no longer take must not reach past them (depth 6)
    "at-capacity": dict(k=6, every=1, prompts=2, prompt_len=220, max_tokens=lambda i: 200),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "eagle3", "dflash"])
def test_head_graph_chains_are_the_eager_chains(tmp_path, family, case, monkeypatch):
    from trtedge.runtime.speculative.decoder import SpeculativeDecoder
    from trtedge.runtime.speculative.dflash import DFlashProposer
    from trtedge.runtime.speculative.eagle3 import Eagle3Proposer
    from trtedge.runtime.speculative.mtp import MtpProposer

    if family == "nemotron_h" and case != "mixed-ends":
        pytest.skip("the graph steps do not depend on the MTP module's layout past one case")
    c = CASES[case]
    max_positions = CAPACITY if case == "at-capacity" else 512
    model, tokenizer, spec, head = _setup(tmp_path, family, c["k"], max_positions)
    proposer_class = {"eagle3": Eagle3Proposer, "dflash": DFlashProposer}.get(family, MtpProposer)
    original = proposer_class.propose
    prompts = repetitive_prompts(c["prompts"], seed=3)
    if c["prompt_len"]:
        prompts = [(p * 20)[: c["prompt_len"]] for p in prompts]
    params = [
        SamplingParams(max_tokens=c["max_tokens"](i), temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain, _ = generate(model, tokenizer, prompts, params)
    if c["every"] > 1:
        limit = SpeculativeDecoder._limit
        monkeypatch.setattr(
            SpeculativeDecoder,
            "_limit",
            lambda self, s: limit(self, s) if s.num_tokens % c["every"] == 0 else 0,
        )
    seen, catch_up = {}, []
    try:
        for graphs in (False, True):
            if graphs:  # DFlash: 8 blocks of 4 rows
                rows = 2 * MAX_ROWS if family == "dflash" else MAX_ROWS
                monkeypatch.setattr(speculative, "_head_graphs", _eager_graphs(rows))
            calls = seen[graphs] = []

            def recording(self, seqs, limits, calls=calls, graphs=graphs):
                if graphs and not catch_up and self.graphs is not None:
                    catch_up.append(_largest_catch_up(self.graphs))
                drafts = original(self, seqs, limits)
                calls.append([(list(s.token_ids), d) for s, d in zip(seqs, host_drafts(drafts))])
                return drafts

            monkeypatch.setattr(proposer_class, "propose", recording)
            outs, engine = generate(model, tokenizer, prompts, params, speculative=spec, draft=head())
            assert outs == plain
            proposer = engine.speculative.proposer
            assert (proposer.graphs is not None) == graphs
            if graphs:  # every proposal but the ones right after a prefill ran the graphs' steps
                assert proposer.graphs.num_replays >= max(len(calls) - len(prompts), 1)
            cache = proposer.cache
            assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
            if engine.blocks.state is not None:
                assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots
    finally:
        model.aux_layers, model.aux_hidden = (), None
    assert seen[True] == seen[False] and len(seen[True]) > 3
    lengths = {len(d) for step in seen[True] for _, d in step if d is not None}
    k = spec.num_speculative_tokens
    assert k in lengths and len(lengths) > 1  # whole chains, and chains cut at a request's end
    if case == "catch-up":
        assert max(catch_up[0]) > 1


def test_the_reference_attention_reads_a_decode_step_from_the_tables_tensor():
    """The tables-tensor path (what a graph's static inputs carry) equals the per-sequence path over
    host tables, with a sliding window and with a softcap."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(10, 4, 2, 8), torch.randn(10, 4, 2, 8)
    tables, context = [torch.tensor([3, 1, 7]), torch.tensor([2, 5, 0])], [9, 6]
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    slots = torch.tensor([1 * 4 + 0, 5 * 4 + 1])  # each row's last context position
    for window, softcap in ((0, None), (3, None), (0, 5.0)):
        attention = TorchAttention(0.3, window, softcap)
        host = AttentionBatch(slots, [1, 1], context, tables, 4)
        device = AttentionBatch(
            slots,
            [1, 1],
            [1, 1],
            [],
            4,
            tables_tensor=torch.stack(tables).int(),
            context_lens_tensor=torch.tensor(context, dtype=torch.int32),
        )
        expected = attention(q, k, v, k_cache.clone(), v_cache.clone(), host)
        got = attention(q, k, v, k_cache.clone(), v_cache.clone(), device)
        torch.testing.assert_close(got, expected)


def test_a_head_whose_graphs_cuda_refuses_to_capture_drafts_eagerly_and_says_so(
    tmp_path, monkeypatch, caplog
):
    """A capture CUDA refuses (an operation a graph cannot hold) leaves the proposer drafting eagerly,
    with a warning naming the method and the cause; output still equals plain decoding. Any other error
    while building the graphs is a real one and stops the engine's start."""

    class Refused(HeadGraphSpec):
        def build(self, *args):
            raise CaptureFailed("operation not permitted when stream is capturing")

    class Broken(HeadGraphSpec):
        def build(self, *args):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    model, tokenizer, spec, head = _setup(tmp_path, "qwen3_5", 3, 512)
    prompts = repetitive_prompts(2, seed=3)
    plain, _ = generate(model, tokenizer, prompts)
    monkeypatch.setattr(speculative, "_head_graphs", lambda runner, depth, *a: Refused(depth, 16, 64))
    with caplog.at_level("WARNING", logger="trtedge"):
        outs, engine = generate(model, tokenizer, prompts, speculative=spec, draft=head())
    assert outs == plain and engine.speculative.proposer.graphs is None
    assert engine.speculative.stats.draft_tokens > 0
    assert any(
        "(mtp): the draft's CUDA graphs could not be captured (operation not permitted" in r.getMessage()
        and "drafts eagerly" in r.getMessage()
        for r in caplog.records
    )
    monkeypatch.setattr(speculative, "_head_graphs", lambda runner, depth, *a: Broken(depth, 16, 64))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        generate(model, tokenizer, prompts, speculative=spec, draft=head())
