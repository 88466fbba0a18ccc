"""Qwen3-Omni's thinker with audio against HF transformers on a tiny random checkpoint: the front end
(Whisper's extractor without padding), the audio encoder (Qwen3-ASR's, its projector inside the tower)
and greedy generation through the MoE decoder, alone, batched with text and under chunked prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.test_qwen3_asr import GREEDY, user
from tests.tiny_asr import TOKEN_IDS, make_tiny_qwen3_omni, tone

transformers = pytest.importorskip("transformers")

AUDIO = TOKEN_IDS["<|AUDIO|>"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=512, max_input_len=400, dtype="float32") as llm:
        yield llm


def hf_features(clips: list[np.ndarray]) -> dict:
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    out = fe(
        clips,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


def hf_greedy(hf, ids: list[int], clips: list[np.ndarray]) -> list[int]:
    """HF's greedy continuation of our prompt ids with its own features (one clip at a time, as padding
    a batch of clips to the longest changes the shorter ones' features) and positions."""
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        embeds = torch.cat([hf.model.get_audio_features(**hf_features([c])).last_hidden_state for c in clips])
    inputs = hf.get_input_embeddings()(ids_t)
    inputs[ids_t == AUDIO] = embeds
    out = hf.generate(
        inputs_embeds=inputs,
        attention_mask=torch.ones_like(ids_t),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
    )
    return out[0, -32:].tolist()


@pytest.mark.parametrize("seconds", [0.3, 1.0, 1.63, 2.5])
def test_log_mel_matches_hf(llm, seconds):
    clip = tone(seconds, seed=int(seconds * 10))
    ref = hf_features([clip])
    frames = int(ref["feature_attention_mask"].sum())
    got = llm.audio.features(clip)
    assert got.shape == (frames, 128)
    torch.testing.assert_close(got.T, ref["input_features"][0, :, :frames], atol=1e-5, rtol=0)


def test_audio_encoder_matches_hf(llm, hf):
    clips = [tone(2.5, seed=0), tone(0.7, seed=1), tone(4.2, seed=2)]
    items = [llm.audio.audio(c) for c in clips]
    with torch.no_grad():
        ref = torch.cat([hf.model.get_audio_features(**hf_features([c])).last_hidden_state for c in clips])
    got = llm.model.audio(torch.cat([it.pixels for it in items]), [it.grid for it in items])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_greedy_alone_batched_and_chunked_matches_hf(llm, hf, checkpoint):
    from trtedge import LLM, SamplingParams

    a, b = tone(1.6, seed=3), tone(1.1, seed=5, freq=600)
    one, two = user("w5 w6", a, "w7 w8 w9"), user("w3", a, "w4", b)
    prompts = [llm.encode_prompt(m) for m in (one, two)]
    assert prompts[0].ids.count(AUDIO) == llm.audio.audio_tokens(a.size)
    expected = [hf_greedy(hf, prompts[0].ids, [a]), hf_greedy(hf, prompts[1].ids, [a, b])]
    text = [TOKEN_IDS["<|im_start|>"], 5, 6, 7]
    params = SamplingParams(**GREEDY)
    outs = llm.generate([prompts[0], text, prompts[1]], params)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert outs[1].outputs[0].token_ids == llm.generate(text, params).outputs[0].token_ids
    with LLM(str(checkpoint), max_kv_cache_capacity=256, max_num_batched_tokens=16, dtype="float32") as small:
        assert small.chat(one, params).outputs[0].token_ids == expected[0]
