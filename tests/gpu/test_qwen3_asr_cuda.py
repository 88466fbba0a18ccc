"""Qwen3-ASR on CUDA: the audio encoder against the CPU reference, and greedy output with audio clips
(Triton prefill cut inside the clips, fused decode, CUDA graphs, batched with a text request) against
HF transformers; the same greedy check for the Qwen2.5-Omni and Qwen3-Omni thinkers."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_qwen3_asr import GREEDY, hf_greedy, user
from tests.tiny_asr import TOKEN_IDS, make_tiny_qwen3_asr, tone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_audio_encoder_on_the_gpu_matches_the_cpu(checkpoint, dtype):
    from trtedge import LLM

    clips = [tone(2.5, seed=0), tone(0.7, seed=1), tone(4.2, seed=2)]
    with LLM(str(checkpoint), device="cpu", dtype="float32", max_kv_cache_capacity=256) as cpu:
        items = [cpu.audio.audio(c) for c in clips]
        feats, grids = torch.cat([it.pixels for it in items]), [it.grid for it in items]
        ref = cpu.model.audio(feats, grids)
    with LLM(str(checkpoint), device="cuda", dtype=dtype, max_kv_cache_capacity=256) as gpu:
        got = gpu.model.audio(feats, grids).float().cpu()
    tol = 1e-3 if dtype == "float32" else 5e-2
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_greedy_with_audio_matches_transformers_on_the_gpu(checkpoint):
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    hf = transformers.Qwen3ASRForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    a, b = tone(1.6, seed=3), tone(2.1, seed=5, freq=600)
    conversations = [user("w5 w6", a, "w7 w8 w9"), user("w3", a, "w4", b)]
    clips = [[a], [a, b]]
    with LLM(
        str(checkpoint),
        device="cuda",
        dtype="float32",
        max_kv_cache_capacity=512,
        max_batch_size=3,
        enable_in_flight_batching=True,
        max_num_batched_tokens=32,  # the clips are cut by prefill chunks
    ) as llm:
        prompts = [llm.encode_prompt(m) for m in conversations]
        text = [TOKEN_IDS["<|im_start|>"], 5, 6, 7]
        alone = [t for d in llm.generate_stream(text, SamplingParams(**GREEDY)) for t in d.token_ids]
        streams = [llm.generate_stream(p, SamplingParams(**GREEDY)) for p in [*prompts, text]]
        outputs = [[t for d in s for t in d.token_ids] for s in streams]
    assert outputs[:2] == [hf_greedy(hf, p, c) for p, c in zip(prompts, clips)]
    assert outputs[2] == alone


def test_qwen2_5_omni_thinker_greedy_with_audio_matches_transformers_on_the_gpu(tmp_path):
    pytest.importorskip("transformers")
    from tests.runtime.test_qwen2_5_omni import hf_greedy, load_hf
    from tests.tiny_asr import make_tiny_qwen2_5_omni
    from trtedge import LLM, SamplingParams

    path = make_tiny_qwen2_5_omni(tmp_path / "omni")
    model = load_hf(path)
    a, b = tone(1.6, seed=3), tone(1.1, seed=5, freq=600)
    with LLM(
        str(path), device="cuda", dtype="float32", max_kv_cache_capacity=512, max_num_batched_tokens=32
    ) as llm:
        prompt = llm.encode_prompt(user("w3", a, "w4", b))
        out = [t for d in llm.generate_stream(prompt, SamplingParams(**GREEDY)) for t in d.token_ids]
    assert out == hf_greedy(model, prompt.ids, [a, b])


def test_qwen3_omni_thinker_greedy_with_audio_matches_transformers_on_the_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.runtime.test_qwen3_omni import hf_greedy
    from tests.tiny_asr import make_tiny_qwen3_omni
    from trtedge import LLM, SamplingParams

    path = make_tiny_qwen3_omni(tmp_path / "omni3")
    hf = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    a, b = tone(1.6, seed=3), tone(0.8, seed=5, freq=600)
    with LLM(
        str(path), device="cuda", dtype="float32", max_kv_cache_capacity=512, max_num_batched_tokens=32
    ) as llm:
        prompt = llm.encode_prompt(user("w3", a, "w4", b))
        out = [t for d in llm.generate_stream(prompt, SamplingParams(**GREEDY)) for t in d.token_ids]
    assert out == hf_greedy(hf.eval(), prompt.ids, [a, b])
