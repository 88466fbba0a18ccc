"""Qwen3-Omni's speech output on CUDA: the Talker's and code predictor's greedy codes and Code2Wav's
waveform equal the CPU pipeline's (itself checked against HF transformers in
tests/runtime/test_qwen3_omni_speech.py) in float32, whole and streamed in chunks; bfloat16 speaks a
whole answer as a well-formed WAV whose length follows from its codes."""

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


def _llm(checkpoint, device: str, dtype: str):
    from trtedge import LLM

    return LLM(str(checkpoint), device=device, dtype=dtype, max_kv_cache_capacity=256, max_input_len=128)


def _speak(llm, chunk_frames: int):
    from trtedge import SamplingParams
    from trtedge.runtime.speech.api import SpeechOptions, answer_ids

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
    with _llm(checkpoint, "cpu", "float32") as llm:
        cpu = _speak(llm, chunk_frames)
    with _llm(checkpoint, "cuda", "float32") as llm:
        gpu = _speak(llm, chunk_frames)
    assert gpu[0] == cpu[0]  # the thinker's text
    assert gpu[1] == cpu[1] and len(gpu[1]) == FRAMES  # greedy codes
    assert [p.shape for p in gpu[2]] == [p.shape for p in cpu[2]]
    np.testing.assert_allclose(np.concatenate(gpu[2]), np.concatenate(cpu[2]), atol=1e-4, rtol=0)


def test_bfloat16_speaks_a_whole_answer_as_a_well_formed_wav(checkpoint):
    """bfloat16 is not float32: near-tied greedy codes may part from the float32 run and end at
    another length. What it is held to: it speaks to the end, its frames are codec frames, its
    waveform's length follows from its frames (streamed or whole), a WAV of it reads back, and
    Code2Wav in bfloat16 follows float32's waveform on the same codes."""
    check_bfloat16_speech(checkpoint, "cuda")


def check_bfloat16_speech(checkpoint, device: str) -> None:
    import io
    import wave

    from trtedge.runtime.speech.encode import Encoder

    with _llm(checkpoint, device, "bfloat16") as llm:
        _, frames, pieces = _speak(llm, 5)
        speech = llm.speech_output
        cfg, tail, per_frame = speech.cfg, speech.code2wav.tail, speech.cfg.samples_per_frame
        assert 1 <= len(frames) <= FRAMES
        assert all(
            len(f) == cfg.num_code_groups and all(0 <= c < cfg.codebook_size for c in f) for f in frames
        )
        # the waveform of these frames, streamed in 5-frame pieces and whole
        streamed = np.concatenate([p.cpu().numpy() for p in speech.waveform(frames, 5)])
        whole = speech.code2wav(torch.tensor(frames)).cpu().numpy()
        assert streamed.shape == whole.shape == (len(frames) * per_frame - tail,)
        assert streamed.dtype == np.float32 and np.isfinite(streamed).all() and np.abs(streamed).max() <= 1.0
    # speech_stream's own run: whole frames' worth of samples, less the one tail; a WAV of it reads back
    audio = np.concatenate(pieces)
    assert (audio.shape[0] + tail) % per_frame == 0 and 1 <= (audio.shape[0] + tail) // per_frame <= FRAMES
    encoder = Encoder("wav", 24000)
    data = encoder.feed(audio) + encoder.finish()
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == audio.shape[0]
    with _llm(checkpoint, device, "float32") as llm:
        reference = llm.speech_output.code2wav(torch.tensor(frames)).cpu().numpy()
    assert np.corrcoef(whole, reference)[0, 1] > 0.95
