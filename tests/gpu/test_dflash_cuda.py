"""DFlash speculative decoding on CUDA: greedy output equals plain decoding in float32 alone and in a
batch of 8 with every KV block and draft row freed, verify steps replay the decode CUDA graphs (captured
again with the draft's hidden-state taps), and the drafts equal the CPU torch reference of the published
layout. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.dflash_tiny import Reference, write_dflash
from tests.runtime.spec_helpers import host_drafts, repetitive_prompts
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _outputs(target, batch: int, spec=None, seen=None) -> list[list[int]]:
    with LLM(
        str(target),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_batch_size=batch,
        enable_in_flight_batching=batch > 1,
        engine_process=False,  # the test reads the engine's pools
        speculative_config=spec,
    ) as llm:
        engine = llm.engine
        if seen is not None:
            proposer = engine.speculative.proposer
            propose = proposer.propose

            def recording(seqs, limits):
                drafts = propose(seqs, limits)
                seen.extend(
                    (list(s.token_ids), d.tokens if d else None) for s, d in zip(seqs, host_drafts(drafts))
                )
                return drafts

            proposer.propose = recording
        outs = [o.token_ids for o in llm.generate(repetitive_prompts(8, seed=11), GREEDY)]
        if spec is not None:
            assert llm.speculative_metrics()["steps"] > 0
            # the target's steps keep the draft's hidden-state taps inside the CUDA graphs
            assert engine.runner.graphs.aux_layers == engine.runner.model.aux_layers
            assert engine.speculative.graph_steps > 0
            cache = engine.speculative.proposer.cache
            assert not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        return outs


def test_dflash_greedy_on_cuda_matches_plain_and_drafts_as_the_reference(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    write_dflash(tmp_path / "d")
    plain = _outputs(target, 8)
    spec = {"method": "dflash", "model": str(tmp_path / "d"), "num_speculative_tokens": 3}
    seen: list = []
    assert _outputs(target, 8, spec, seen) == plain
    assert _outputs(target, 1, spec) == plain
    reference = Reference(target, tmp_path / "d")
    for tokens, drafts in seen[::7]:
        assert drafts == reference.block_logits(tokens).argmax(dim=-1).tolist()[: len(drafts)]
