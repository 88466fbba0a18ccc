"""Decode CUDA graphs over hybrid models' recurrent layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
Nemotron-H): greedy output with the graphs equals eager and HF transformers in float32, batched equals
alone, and preemption, context reuse (checkpoints taken inside graphed decode steps) and speculative
verification (eager) keep it; every KV block and state slot is freed. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_hybrid_checkpoint, make_tiny_nemotron_h_checkpoint
from trtedge import LLM, ContextCacheConfig, SamplingParams
from trtedge.runtime.engine import Engine, EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h"]


def checkpoint(family: str, directory):
    if family == "nemotron_h":
        return make_tiny_nemotron_h_checkpoint(directory)
    return make_tiny_hybrid_checkpoint(
        directory, vision=False, moe=family != "qwen3_5", family=family.removesuffix("_moe")
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(24, 1), prompt(150, 2), prompt(7, 3), prompt(40, 4), prompt(61, 5)]


def hybrid_llm(path, eager: bool, **options) -> LLM:
    defaults = dict(
        dtype="float32",
        device="cuda",
        max_kv_cache_capacity=512,
        max_input_len=256,
        max_batch_size=4,
        enable_in_flight_batching=True,
        engine_process=False,  # the test reads the runner's graphs and pools
        enforce_eager=eager,
    )
    return LLM(str(path), **{**defaults, **options})


def run(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], list[list[int]]]:
    """(each prompt alone, all of them batched); asserts the pools end empty."""
    alone = [llm.generate(p, params).token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats()
    assert stats["state_slots_free"] == stats["state_slots_total"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return alone, batched


@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_greedy_equals_eager_and_transformers(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = checkpoint(family, tmp_path / "m")
    with hybrid_llm(path, eager=False) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.states is llm.engine.runner.states
        alone, batched = run(llm, PROMPTS)
        assert graphs.num_replays >= len(PROMPTS) * (GREEDY.max_tokens - 1)
    with hybrid_llm(path, eager=True) as llm:
        assert llm.engine.runner.graphs is None
        eager_alone, eager_batched = run(llm, PROMPTS)
    assert alone == eager_alone
    assert batched == alone and eager_batched == eager_alone
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for ids, out in zip(PROMPTS, alone):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out], device="cuda")).logits[0]
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_graphed_decode_survives_preemption(family, tmp_path):
    path = checkpoint(family, tmp_path / "m")
    prompts = [prompt(20, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with hybrid_llm(path, eager=False, max_batch_size=1) as llm:
        expected = [llm.generate(p, params).token_ids for p in prompts]
        # 6 blocks of 16 tokens for 4 seats of up to 60 tokens: the scheduler must preempt
        config = EngineConfig(
            max_batch_size=4, max_kv_cache_capacity=64, enable_in_flight_batching=True, num_blocks=6
        )
        engine = Engine(llm.model, llm.tokenizer, config)
    try:
        assert engine.runner.graphs is not None
        outs = [[t for d in s for t in d.token_ids] for s in [engine.submit(p, params) for p in prompts]]
        assert engine.stats.preemptions > 0
        assert engine.runner.graphs.num_replays > 0
        assert engine.blocks.state.num_free_slots == 4 and engine.blocks.num_free_blocks == 6
    finally:
        engine.shutdown()
    assert outs == expected


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_a_checkpoint_saved_by_a_graphed_decode_step_resumes_the_next_turn(family, tmp_path):
    """The first turn's generated tokens cross block ends in graphed decode steps; the second turn
    reuses a prefix past the first prompt, so its state comes from one of those checkpoints."""
    path = checkpoint(family, tmp_path / "m")
    first_prompt = prompt(40, 9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reuse = ContextCacheConfig(enabled=True)
    with hybrid_llm(path, eager=False, context_cache_config=reuse) as warm:
        first = warm.generate(first_prompt, params)
        second_prompt = first_prompt + first.token_ids + prompt(5, 10)
        second = warm.generate(second_prompt, params)
        assert warm.engine.runner.graphs.num_replays > 0
    with hybrid_llm(path, eager=True) as cold:
        reference = cold.generate(second_prompt, params).token_ids
    assert second.metrics.reused_tokens > len(first_prompt)
    assert second.token_ids == reference


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_ngram_speculation_verifies_eagerly_between_graphed_decode_steps(family, tmp_path):
    from tests.runtime.spec_helpers import repetitive_prompts

    path = checkpoint(family, tmp_path / "m")
    prompts = repetitive_prompts(4)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with hybrid_llm(path, eager=True) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with hybrid_llm(path, eager=False, speculative_config=spec) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.speculative_metrics()["steps"] > 0
        stats = llm.stats()
        assert stats["state_slots_free"] == stats["state_slots_total"]
    assert outs == plain


def test_bfloat16_graphs_track_eager(tmp_path):
    """bf16 (the CUDA default): graphed and eager decode run the same kernels on the same inputs."""
    path = checkpoint("qwen3_5", tmp_path / "m")
    outs = []
    for eager in (False, True):
        with hybrid_llm(path, eager=eager, dtype="bfloat16") as llm:
            outs.append(run(llm, PROMPTS[:3]))
    assert outs[0] == outs[1]
