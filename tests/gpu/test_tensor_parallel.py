"""Tensor parallelism on 2 GPUs with NCCL: TP=2 greedy output against TP=1 on the same tiny checkpoints
(float32, the Triton decode kernels and split-K products on the sliced heads). Skips cleanly without
two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 200], [1, *range(40, 90)], [1, 2, 3]]


def _generate(path, cache, tp: int) -> list[list[int]]:
    with LLM(
        str(path),
        cache_dir=str(cache),
        device="cuda",
        dtype="float32",
        tensor_parallel_size=tp,
        max_kv_cache_capacity=256,
        max_batch_size=4,
        max_num_batched_tokens=32,
        enable_in_flight_batching=True,
    ) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_two_gpus_match_one(tmp_path, family):
    path = make_tiny_checkpoint(tmp_path / family, family)
    one = _generate(path, tmp_path / "cache", 1)
    assert _generate(path, tmp_path / "cache", 2) == one
