"""Tensor parallelism on 2 (and 4) GPUs with NCCL: TP=N greedy output against TP=1 on the same tiny
checkpoints (float32), decode steps through CUDA graphs with the all-reduces and the logits' all-gather
captured inside them, and eagerly. Skips cleanly without enough CUDA devices."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint
from trtedge import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 200], [1, *range(40, 90)], [1, 2, 3]]


def _make(path, family: str):
    if family == "qwen3_5_text":
        return make_tiny_hybrid_checkpoint(path, vision=False)
    return make_tiny_checkpoint(path, family)


def _generate(path, cache, tp: int, eager: bool = False, weights: str = "auto") -> list[list[int]]:
    with LLM(
        str(path),
        cache_dir=str(cache),
        device="cuda",
        dtype="float32",
        weights=weights,
        tensor_parallel_size=tp,
        max_kv_cache_capacity=256,
        max_batch_size=4,
        max_num_batched_tokens=32,
        enable_in_flight_batching=True,
        enforce_eager=eager,
        engine_process=False,  # the test reads the runner's graphs (tensor parallel is in-process anyway)
    ) as llm:
        out = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        graphs = llm.engine.runner.graphs
        if not eager:  # rank 0 replayed its graphs (and the workers with it, or it would hang)
            assert graphs is not None and graphs.num_replays >= GREEDY.max_tokens - 1
        return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "gemma3", "qwen3_moe", "qwen3_5_text"])
def test_two_gpus_match_one_through_cuda_graphs(tmp_path, family):
    path = _make(tmp_path / family, family)
    one = _generate(path, tmp_path / "cache", 1)
    assert _generate(path, tmp_path / "cache", 2) == one


def test_two_gpus_match_one_eagerly(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    one = _generate(path, tmp_path / "cache", 1, eager=True)
    assert _generate(path, tmp_path / "cache", 2, eager=True) == one


def test_two_gpus_match_one_with_int8_weights(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    one = _generate(path, tmp_path / "cache", 1, weights="int8")
    assert _generate(path, tmp_path / "cache", 2, weights="int8") == one


def _four_kv_heads(directory):
    """A tiny llama whose 4 attention and 4 KV heads split over 4 ranks (the shared tiny ones have 2)."""
    import transformers

    from tests.tiny import VOCAB, write_word_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, initializer_range=0.1, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory)
    return directory


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_four_gpus_match_one(tmp_path):
    path = _four_kv_heads(tmp_path / "llama4")
    one = _generate(path, tmp_path / "cache", 1)
    assert _generate(path, tmp_path / "cache", 4) == one
    assert _generate(path, tmp_path / "cache", 2) == one


def test_a_dead_worker_fails_the_request_instead_of_hanging_in_a_graph(tmp_path):
    """The worker dies while rank 0 replays decode graphs: the watchdog aborts the NCCL communicator,
    so the step fails (and the server would answer 503) instead of spinning in a captured all-reduce."""
    import os
    import signal

    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with LLM(
        str(path), cache_dir=str(tmp_path / "cache"), device="cuda", dtype="float32",
        tensor_parallel_size=2, max_kv_cache_capacity=256, max_batch_size=4,
    ) as llm:  # fmt: skip
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        with pytest.raises(RuntimeError, match="rank 1 exited|tensor-parallel"):
            for i, _ in enumerate(llm.generate_stream([1, 2, 3], params)):
                if i == 2:
                    os.kill(llm.tp.processes[0].pid, signal.SIGKILL)
        assert "rank 1 exited" in llm.stats()["engine_error"]
