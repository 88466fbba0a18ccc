"""Speculative decoding on CUDA: chains verify through the Triton decode kernel (one row per node),
trees through the torch reference under the ancestor mask; greedy output must equal plain decoding
in float32. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.eagle3_tiny import make_eagle3_head
from tests.runtime.spec_helpers import repetitive_prompts
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _outputs(path, batch: int = 8, **kw) -> list[list[int]]:
    with LLM(
        str(path),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_batch_size=batch,
        enable_in_flight_batching=batch > 1,
        engine_process=False,  # the test reads the engine's pools
        **kw,
    ) as llm:
        outs = llm.generate(repetitive_prompts(8, seed=11), GREEDY)
        engine = llm.engine
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        if kw.get("speculative_config"):
            assert llm.speculative_metrics()["steps"] > 0
            cache = getattr(engine.speculative.proposer, "cache", None)
            assert cache is None or (
                not cache.states and cache.blocks.num_free_blocks == cache.blocks.num_blocks
            )
        return [o.token_ids for o in outs]


@pytest.mark.parametrize("batch", [8, 1], ids=["batch-of-8", "alone"])
def test_speculative_greedy_on_cuda_matches_plain(tmp_path, batch):
    """ngram, draft_model and an EAGLE-3 tree: greedy equals plain decoding in float32, every KV block
    and draft row freed."""
    target = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    draft = make_tiny_checkpoint(tmp_path / "d", "qwen3", seed=5)
    head = make_eagle3_head(tmp_path / "e", 64, 512)
    plain = _outputs(target)
    for spec in (
        {"method": "ngram"},
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_top_k": 3},
    ):
        assert _outputs(target, batch, speculative_config=spec) == plain, spec


def test_verify_and_draft_steps_replay_cuda_graphs(tmp_path):
    """Chains verify through the target's decode graphs (one row per node; an EAGLE-3 target's graphs
    keep its taps) and the draft model drafts through its own, its steps chained on the device; requests with different limits (max_tokens) end
    their chains at different steps. Greedy output equals plain decoding in float32."""
    target = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    draft = make_tiny_checkpoint(tmp_path / "d", "qwen3", seed=5)
    prompts = repetitive_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 9, 17, 24, 31, 40)]

    def outputs(spec):
        with LLM(
            str(target),
            device="cuda",
            dtype="float32",
            max_kv_cache_capacity=256,
            max_input_len=128,
            max_batch_size=8,
            engine_process=False,  # the test reads the decoder's counters
            speculative_config=spec,
        ) as llm:
            streams = [llm.generate_stream(p, sp) for p, sp in zip(prompts, params)]  # all in flight at once
            outs = [[t for delta in s for t in delta.token_ids] for s in streams]
            decoder = llm.engine.speculative
            if decoder is not None:
                assert decoder.graph_steps == decoder.verify_steps > 0
                assert (
                    getattr(decoder.proposer, "graphs", None) is not None or spec["method"] != "draft_model"
                )
            return outs

    head = make_eagle3_head(tmp_path / "e", 64, 512, aux_layers=(0, 1, 2))
    plain = outputs(None)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        # the target's graphs are captured again with the head's hidden-state taps
        {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    ):
        assert outputs(spec) == plain, spec


def test_rows_past_the_captured_graphs_are_logged_at_start(tmp_path, caplog):
    """A batch whose verify rows exceed the graphs' cap says so at start, then still decodes as plain
    decoding does (those steps eagerly)."""
    target = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    plain = _outputs(target)
    with caplog.at_level("INFO", logger="trtedge"):
        out = _outputs(target, 64, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert out == plain
    said = [r.getMessage() for r in caplog.records if "CUDA graphs are captured up to" in r.getMessage()]
    assert said and "256 rows" in said[0] and "64 sequences x 5 rows" in said[0], said
