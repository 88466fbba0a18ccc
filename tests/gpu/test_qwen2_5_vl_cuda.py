"""Qwen2.5-VL on CUDA: the vision encoder against the CPU reference, and greedy output with an image
and a video (Triton prefill, fused decode, CUDA graphs) against HF transformers."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_qwen2_5_vl import GREEDY, hf_greedy, user
from tests.tiny_vl import make_tiny_qwen2_5_vl, random_image

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vision_encoder_on_the_gpu_matches_the_cpu(checkpoint, dtype):
    from trtedge import LLM

    with LLM(str(checkpoint), device="cpu", dtype="float32", max_kv_cache_capacity=256) as cpu:
        items = [cpu.vision.image(random_image(40, 56, 0)), cpu.vision.image(random_image(300, 200, 1))]
        items.append(cpu.vision.video([random_image(48, 40, s) for s in range(4)], fps=2.0))
        grids = [it.grid for it in items]
        pixels = torch.cat([it.pixels for it in items])
        ref = cpu.model.vision(pixels, grids)
    with LLM(str(checkpoint), device="cuda", dtype=dtype, max_kv_cache_capacity=256) as gpu:
        got = gpu.model.vision(pixels, grids).float().cpu()
    tol = 1e-3 if dtype == "float32" else 5e-2
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_greedy_with_media_matches_transformers_on_the_gpu(checkpoint):
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()
    conversations = [
        user("w5 w6 w7", random_image(40, 56, 0), "w8 w9"),
        user("w20 w21", [random_image(48, 40, s) for s in range(4)], "w22"),
    ]
    with LLM(
        str(checkpoint),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=512,
        max_batch_size=2,
        enable_in_flight_batching=True,
        max_num_batched_tokens=32,  # the media are cut by prefill chunks
    ) as llm:
        prompts = [llm.encode_prompt(m) for m in conversations]
        streams = [llm.generate_stream(p, SamplingParams(**GREEDY)) for p in prompts]
        outputs = [[t for d in s for t in d.token_ids] for s in streams]
    assert outputs == [hf_greedy(hf, p) for p in prompts]


def test_qwen3_vl_greedy_with_media_matches_transformers_on_the_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.tiny_vl import make_tiny_qwen3_vl
    from trtedge import LLM, SamplingParams

    path = make_tiny_qwen3_vl(tmp_path / "qwen3_vl")
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    messages = user("w5 w6", random_image(40, 56, 0), "w7", [random_image(48, 40, s) for s in range(4)])
    with LLM(str(path), device="cuda", dtype="float32", max_kv_cache_capacity=512) as llm:
        prompt = llm.encode_prompt(messages)
        out = llm.chat(messages, SamplingParams(**GREEDY)).token_ids
    assert out == hf_greedy(hf, prompt, video_seconds=False)


def test_a_repeated_image_reusing_every_full_block_on_the_gpu(checkpoint):
    """The second request computes only its last prompt token: a one-row step with M-RoPE positions,
    which must not go to the CUDA decode graphs (they take 1D positions)."""
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()
    messages = user("w5 w6 w7", random_image(40, 56, 0), "w8 w9 w10 w11")
    with LLM(
        str(checkpoint),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=512,
        context_cache_config={"enabled": True},
    ) as llm:
        prompt = llm.encode_prompt(messages)
        assert len(prompt) % 16 == 1
        first = llm.chat(messages, SamplingParams(**GREEDY))
        again = llm.chat(messages, SamplingParams(**GREEDY))
    assert again.metrics.reused_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids == hf_greedy(hf, prompt)
