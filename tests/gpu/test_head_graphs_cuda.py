"""A draft head's chains in CUDA graphs (``speculative/head_graphs.py``: MTP layers of Qwen3.5 and
Nemotron-H, an EAGLE-3 head, DFlash blocks): in float32 the chains the captured steps draft equal the eager
proposer's, proposal after proposal of a batch whose requests end at different steps; greedy output
equals plain decoding; the draft rows are freed. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.spec_helpers import head_checkpoint, host_drafts, repetitive_prompts
from trtedge import LLM, SamplingParams
from trtedge.runtime import speculative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _target(tmp_path, family):
    path, draft = head_checkpoint(tmp_path, family)
    if draft is None:  # MTP layers in the target's checkpoint
        return path, {"method": "mtp", "num_speculative_tokens": 4}
    k = 3 if family == "dflash" else 4  # DFlash: a block of 4
    return path, {"method": family, "model": str(draft), "num_speculative_tokens": k}


@pytest.mark.parametrize("case", ["mixed-ends", "at-capacity"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "eagle3", "dflash"])
def test_head_chains_in_cuda_graphs_are_the_eager_chains(tmp_path, family, case, monkeypatch):
    """``at-capacity``: requests run into the KV capacity with 6 draft tokens (DFlash: 3), the rotary
    tables exactly that long: a chain's steps past what a request may take write to scratch."""
    from trtedge.runtime.speculative.dflash import DFlashProposer
    from trtedge.runtime.speculative.eagle3 import Eagle3Proposer
    from trtedge.runtime.speculative.mtp import MtpProposer

    if family == "nemotron_h" and case == "at-capacity":
        pytest.skip("the chain's steps do not depend on the MTP module's layout")
    path, spec = _target(tmp_path, family)
    proposer_class = {"eagle3": Eagle3Proposer, "dflash": DFlashProposer}.get(family, MtpProposer)
    original = proposer_class.propose
    prompts = repetitive_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 9, 17, 24, 31, 40)]
    if case == "at-capacity":
        prompts = [(p * 20)[:220] for p in prompts[:2]]
        params = [SamplingParams(max_tokens=36, temperature=0, ignore_eos=True)] * 2  # to the capacity
        if family != "dflash":
            spec = spec | {"num_speculative_tokens": 6}

    def run(spec, graphs: bool):
        calls = []

        def recording(self, seqs, limits):
            drafts = original(self, seqs, limits)
            calls.append([(list(s.token_ids), d) for s, d in zip(seqs, host_drafts(drafts))])
            return drafts

        with monkeypatch.context() as patch:
            patch.setattr(proposer_class, "propose", recording)
            if not graphs:
                patch.setattr(speculative, "_head_graphs", lambda *args: None)
            with LLM(
                str(path),
                device="cuda",
                dtype="float32",
                max_kv_cache_capacity=256,
                max_input_len=240,
                max_batch_size=8,
                engine_process=False,  # the test reads the proposer
                speculative_config=spec,
            ) as llm:
                streams = [llm.generate_stream(p, sp) for p, sp in zip(prompts, params)]
                outs = [[t for delta in s for t in delta.token_ids] for s in streams]
                if spec is not None:
                    proposer = llm.engine.speculative.proposer
                    assert (proposer.graphs is not None) == graphs
                    if graphs:
                        assert proposer.graphs.num_replays >= len(calls) - len(prompts) > 0
                    cache = proposer.cache
                    assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
        return outs, calls

    plain, _ = run(None, False)
    eager, eager_calls = run(spec, False)
    graphed, graph_calls = run(spec, True)
    assert eager == plain and graphed == plain
    assert graph_calls == eager_calls and len(graph_calls) > 3
    if case == "at-capacity":
        assert max(len(p) + len(o) for p, o in zip(prompts, graphed)) == 256
