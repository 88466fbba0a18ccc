"""Gemma 3n / Gemma 4 text on CUDA (float32): 64 greedy tokens = HF after prompts longer than the
sliding window, batched (CUDA graphs) = alone, and the cached PLE pool (graphs off) = resident.
Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import PLE_FAMILIES, PLE_VOCAB, make_tiny_ple_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=sorted(PLE_FAMILIES))
def tiny(request, tmp_path_factory):
    return make_tiny_ple_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, PLE_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cuda_llm(path, **options):
    from trtedge import LLM

    return LLM(
        str(path),
        **{
            "dtype": "float32",
            "device": "cuda",
            "max_kv_cache_capacity": 256,
            "max_input_len": 128,
            **options,
        },
    )


def test_greedy_64_tokens_match_transformers_batched_and_cached_on_gpu(tiny):
    import transformers

    from tests.test_engine import in_threads
    from trtedge import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = [prompt(n, 20 + n) for n in (40, 9, 27, 60)]  # sliding window 8
    with cuda_llm(tiny) as llm:
        alone = [llm.generate(p, params).token_ids for p in prompts]
    for ids, out in zip(prompts, alone):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out]).cuda()).logits[0]
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out
    # in this process (engine_process=False): the test reads the runner's graphs
    with cuda_llm(tiny, enable_in_flight_batching=True, max_batch_size=4, engine_process=False) as llm:
        assert llm.engine.runner.graphs is not None  # resident PLE: decode steps replay CUDA graphs
        together = in_threads(lambda p: llm.generate(p, params).token_ids, prompts)
    assert together == alone
    cached = {"residency": "cached", "cache_slots": 17}
    options = dict(enable_in_flight_batching=True, max_batch_size=4, ple_config=cached, engine_process=False)
    with cuda_llm(tiny, **options) as llm:
        assert llm.engine.runner.graphs is None
        got = in_threads(lambda p: llm.generate(p, params).token_ids, prompts)
        stats = llm.stats()["ple_cache"]
    assert got == alone
    assert stats["split_steps"] > 0 and stats["misses"] > 16 and stats["device_bytes"] == 17 * 4 * 8 * 4
