"""Gemma 4's assistant drafter on CUDA: greedy output equals plain decoding in float32 alone and in a
batch of 8 (chains and token trees) with every KV block and hidden row freed, plain steps replayed as
CUDA graphs hand the assistant the rows eager steps hand it, and the drafts and step logits (the Triton
decode kernel over the target's own keys) equal transformers' assistant on the CPU. Skips cleanly
without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.gemma4_assistant_tiny import AssistantReference, make_tiny_assistant
from tests.tiny import PLE_VOCAB, make_tiny_ple_checkpoint
from trtedge import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-assistant")
    return make_tiny_ple_checkpoint(root / "t", "gemma4"), make_tiny_assistant(root / "a", ordered=True)


def prompts(count: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, PLE_VOCAB, (20 + i,), generator=g).tolist() for i in range(count)]


def _llm(path, batch: int, spec=None, eager: bool = False) -> LLM:
    return LLM(
        str(path),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_batch_size=batch,
        enable_in_flight_batching=batch > 1,
        engine_process=False,  # the test reads the engine's pools
        enforce_eager=eager,
        speculative_config=spec,
    )


def _run(path, batch: int, spec=None, eager: bool = False, seen=None) -> list[list[int]]:
    with _llm(path, batch, spec, eager) as llm:
        engine = llm.engine
        if seen is not None:
            proposer = engine.speculative.proposer
            step, propose = proposer.head.step, proposer.propose
            logits = []

            def recording_step(*args):
                out = step(*args)
                logits.append(out[0].cpu())
                return out

            def recording_propose(seqs, limits):
                logits.clear()
                drafts = propose(seqs, limits)
                seen.append(([list(s.token_ids) for s in seqs], drafts, list(logits)))
                return drafts

            proposer.head.step, proposer.propose = recording_step, recording_propose
        outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        if spec is not None:
            assert llm.speculative_metrics()["steps"] > 0
            assert not engine.speculative.proposer.rows
    return outs


@pytest.mark.parametrize("top_k", [1, 2], ids=["chain", "tree"])
def test_assistant_greedy_on_cuda_matches_plain_alone_and_in_a_batch_of_8(paths, top_k):
    target, assistant = paths
    plain = _run(target, 8)
    spec = {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3, "draft_top_k": top_k}
    assert _run(target, 8, spec) == plain
    assert _run(target, 1, spec) == plain


def test_assistant_drafts_on_cuda_match_transformers_and_graph_steps_hand_the_eager_rows(paths):
    target, assistant = paths
    spec = {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3}
    graphs, eager = [], []
    _run(target, 1, spec, seen=graphs)
    _run(target, 1, spec, eager=True, seen=eager)
    assert [(ids, [d.tokens for d in drafts]) for ids, drafts, _ in graphs] == [
        (ids, [d.tokens for d in drafts]) for ids, drafts, _ in eager
    ]
    reference = AssistantReference(target, assistant)
    for ids, drafts, logits in graphs[:6]:
        expected, expected_logits = reference.drafts(ids[0], len(drafts[0]))
        assert drafts[0].tokens == expected
        torch.testing.assert_close(torch.stack([x[0] for x in logits]), expected_logits, rtol=1e-4, atol=1e-4)


def test_assistant_trees_on_cuda_equal_the_cpu_ones(paths):
    """The tree's levels run several rows of one sequence through the Triton decode kernel: each row
    must read the sequence's own table and length (the CPU torch path is the reference)."""
    target, assistant = paths
    spec = {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3, "draft_top_k": 2}
    trees = {}
    for device in ("cpu", "cuda"):
        with LLM(str(target), device=device, dtype="float32", max_kv_cache_capacity=256, max_input_len=128,
                 engine_process=False, speculative_config=spec) as llm:  # fmt: skip
            proposer, seen = llm.engine.speculative.proposer, []
            propose = proposer.propose
            proposer.propose = lambda seqs, limits, seen=seen, propose=propose: (
                seen.append(propose(seqs, limits)) or seen[-1]
            )
            llm.generate(prompts(1)[0], GREEDY)
            trees[device] = [(d.tokens, d.parents) for drafts in seen for d in drafts if d is not None]
    assert trees["cuda"] and trees["cuda"] == trees["cpu"]
