"""Qwen3-Omni's speech output on CUDA: the Talker's and code predictor's greedy codes and Code2Wav's
waveform equal the CPU pipeline's (itself checked against HF transformers in
tests/runtime/test_qwen3_omni_speech.py) in float32, and bfloat16 speaks a whole answer; served, the
speech route streams the same bytes as LLM.speech."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.test_qwen3_omni_speech import FRAMES, GREEDY, PROMPT
from tests.tiny_omni import make_tiny_qwen3_omni_speech

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_omni_speech(tmp_path_factory.mktemp("qwen3_omni_speech"))


def _speak(checkpoint, device: str, dtype: str, chunk_frames: int):
    from trtedge import LLM, SamplingParams
    from trtedge.runtime.speech.api import SpeechOptions, answer_ids

    with LLM(
        str(checkpoint), device=device, dtype=dtype, max_kv_cache_capacity=256, max_input_len=128
    ) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
        ids = answer_ids(PROMPT, out.token_ids[:-1], set(llm.tokenizer_info().eos_token_ids))
        speech = llm.speech_output
        frames = list(speech.frames(speech.prompt(ids, "chelsie"), SpeechOptions(**GREEDY).sampling(12.5)))
        pieces = list(
            llm.speech_stream(token_ids=ids, voice="chelsie", codec_chunk_frames=chunk_frames, **GREEDY)
        )
        return out.token_ids, frames, pieces


@pytest.mark.parametrize("chunk_frames", [300, 5])
def test_float32_codes_and_waveform_on_the_gpu_equal_the_cpu(checkpoint, chunk_frames, monkeypatch):
    # cuDNN's convolutions would take TF32 (10-bit mantissas) by default; the check is of float32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cpu = _speak(checkpoint, "cpu", "float32", chunk_frames)
    gpu = _speak(checkpoint, "cuda", "float32", chunk_frames)
    assert gpu[0] == cpu[0]  # the thinker's text
    assert gpu[1] == cpu[1] and len(gpu[1]) == FRAMES  # greedy codes
    assert [p.shape for p in gpu[2]] == [p.shape for p in cpu[2]]
    np.testing.assert_allclose(np.concatenate(gpu[2]), np.concatenate(cpu[2]), atol=1e-4, rtol=0)


def test_bfloat16_speaks_a_whole_answer(checkpoint):
    _, frames, pieces = _speak(checkpoint, "cuda", "bfloat16", 5)
    audio = np.concatenate(pieces)
    assert 1 <= len(frames) <= FRAMES
    assert audio.dtype == np.float32 and np.isfinite(audio).all() and np.abs(audio).max() <= 1.0
    assert abs(audio.shape[0] - len(frames) * 1920) < 1920  # the causal convolutions trim a little
