"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``): computed in the prefill, through chunked
prefill, prefix reuse, preemption and ``n`` choices, equal to transformers' on the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tiny import VOCAB, make_tiny_checkpoint
from trtedge import LLM, SamplingParams

PROMPT = [5 + (7 * i) % (VOCAB - 10) for i in range(45)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def reference(path, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position (float32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(infos, ids: list[int], expected: torch.Tensor, k: int) -> None:
    assert len(infos) == len(ids) and infos[0] is None
    for i, info in enumerate(infos[1:], start=1):
        row = expected[i - 1]
        assert info.token_id == ids[i]
        assert math.isclose(info.logprob, float(row[ids[i]]), abs_tol=2e-4), (i, info.logprob)
        assert info.rank == int((row > row[ids[i]]).sum()) + 1
        assert len(info.top) == k
        values = row.topk(k).values.tolist()
        assert [lp for _, lp in info.top] == pytest.approx(values, abs=2e-4)
        for t, lp in info.top:
            assert math.isclose(lp, float(row[t]), abs_tol=2e-4)


def test_prompt_logprobs_equal_transformers_through_chunked_prefill(checkpoint):
    expected = reference(checkpoint, PROMPT)
    # 16 tokens a step: the 45-token prompt is prefilled in three chunks
    with LLM(str(checkpoint), max_kv_cache_capacity=128, max_num_batched_tokens=16) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
        plain = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))
    assert_matches(out.prompt_logprobs, PROMPT, expected, 2)
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    # the first generated token is the argmax after the last prompt position
    assert out.token_ids[0] == int(reference(checkpoint, PROMPT)[-1].argmax())


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(checkpoint):
    expected = reference(checkpoint, PROMPT)
    options = dict(max_kv_cache_capacity=128, context_cache_config={"enabled": True})
    with LLM(str(checkpoint), **options) as llm:
        llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))  # caches the prompt's blocks
        out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        again = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        assert llm.stats()["kv_blocks_free"] > 0
    assert_matches(out.prompt_logprobs, PROMPT, expected, 0)
    assert out.metrics.reused_tokens == 0 and again.metrics.reused_tokens > 0


def test_every_choice_and_every_batched_request_gets_the_prompt_logprobs(checkpoint):
    other = PROMPT[::-1][:30]
    options = dict(
        max_kv_cache_capacity=128, enable_in_flight_batching=True, max_batch_size=3, max_num_batched_tokens=32
    )
    with LLM(str(checkpoint), **options) as llm:
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, prompt_logprobs=1)
        a, b = llm.generate([PROMPT, other], params)
        free = llm.stats()["kv_blocks_free"]
        assert free == llm.stats()["kv_blocks_total"]
    assert_matches(a.prompt_logprobs, PROMPT, reference(checkpoint, PROMPT), 1)
    assert_matches(b.prompt_logprobs, other, reference(checkpoint, other), 1)
    assert len(a.outputs) == 2


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
