"""Qwen3-ASR against HF transformers on a tiny random checkpoint: the log-mel front end, the audio
encoder + projector, and greedy generation with audio through ``LLM`` (alone, batched with text
requests, and with chunked prefill cutting the audio placeholders)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tiny_asr import TOKEN_IDS, make_tiny_qwen3_asr, tone
from trtedge.runtime.multimodal import MultimodalPrompt

transformers = pytest.importorskip("transformers")

AUDIO = TOKEN_IDS["<|audio_pad|>"]
GREEDY = dict(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.Qwen3ASRForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=512, max_input_len=400, dtype="float32") as llm:
        yield llm


def hf_features(clip: np.ndarray) -> dict:
    fe = transformers.Qwen3ASRFeatureExtractor()
    out = fe(clip, sampling_rate=16000, padding=True, return_attention_mask=True, n_window=50)
    return {"input_features": out["input_features"], "input_features_mask": out["attention_mask"]}


def hf_greedy(hf, prompt: MultimodalPrompt, clips: list[np.ndarray]) -> list[int]:
    """HF's greedy continuation of our prompt ids, with HF's own features of the clips."""
    ids = torch.tensor([prompt.ids])
    feats = [hf_features(c) for c in clips]
    # HF encodes a batch of clips padded to the longest; one clip at a time keeps each exact
    with torch.no_grad():
        embeds = torch.cat(
            [hf.model.get_audio_features(**f).pooler_output for f in feats]
        )  # (audio tokens, hidden)
    inputs = hf.get_input_embeddings()(ids)
    inputs[ids == AUDIO] = embeds
    out = hf.generate(
        inputs_embeds=inputs,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
    )
    return out[0, -32:].tolist()


def user(*parts) -> list[dict]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "audio", "audio": p} for p in parts
    ]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("seconds", [0.2, 0.7, 1.0, 2.5, 4.33])
def test_log_mel_matches_hf(llm, seconds):
    clip = tone(seconds, seed=int(seconds * 10))
    ref = hf_features(clip)
    frames = int(ref["input_features_mask"].sum())
    got = llm.audio.features(clip)
    assert got.shape == (frames, 128)
    torch.testing.assert_close(got.T, ref["input_features"][0, :, :frames], atol=1e-5, rtol=0)
    # the encoder's mask pads to whole chunks of 100 frames: the rest are padding
    assert ref["input_features"].shape[-1] == -(-frames // 100) * 100


def test_audio_tokens_match_hf_processor_rule(llm):
    from transformers.models.qwen3_asr.processing_qwen3_asr import Qwen3ASRProcessor

    for samples in (1600, 8000, 15999, 16000, 16160, 40000, 123457):
        frames = torch.tensor([max(samples, 8000) // 160])
        expected = int(Qwen3ASRProcessor._get_audio_token_length(None, frames)[0])
        assert llm.audio.audio_tokens(samples) == expected


def test_audio_encoder_matches_hf(llm, hf):
    clips = [tone(2.5, seed=0), tone(0.7, seed=1), tone(4.2, seed=2)]  # windows of 26 tokens cut two
    items = [llm.audio.audio(c) for c in clips]
    with torch.no_grad():
        ref = torch.cat([hf.model.get_audio_features(**hf_features(c)).pooler_output for c in clips])
    got = llm.model.audio(torch.cat([it.pixels for it in items]), [it.grid for it in items])
    assert [it.num_tokens for it in items] == [33, 9, 55]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_greedy_matches_hf(llm, hf):
    from trtedge import SamplingParams

    clip = tone(1.6, seed=3)
    messages = user("w5 w6", clip, "w7 w8 w9")
    prompt = llm.encode_prompt(messages)
    assert isinstance(prompt, MultimodalPrompt) and prompt.positions is None
    assert prompt.ids.count(AUDIO) == llm.audio.audio_tokens(clip.size)
    out = llm.chat(messages, SamplingParams(**GREEDY))
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, [clip])
    other = llm.chat(user("w5 w6", tone(1.6, seed=9, freq=200), "w7 w8 w9"), SamplingParams(**GREEDY))
    assert other.outputs[0].token_ids != out.outputs[0].token_ids  # the clip, not only its length, counts


def test_batched_with_text_and_two_clips(llm, hf):
    """Audio requests in one batch with text-only ones: each gets what it gets alone (= HF)."""
    from trtedge import SamplingParams

    a, b = tone(1.2, seed=4, freq=300), tone(2.1, seed=5, freq=600)
    two = user("w3", a, "w4 w4", b, "w10")
    one = user(b, "w11 w12")
    params = SamplingParams(**GREEDY)
    prompts = [llm.encode_prompt(m) for m in (two, one)]
    text = [[TOKEN_IDS["<|im_start|>"], 5, 6, 7], [TOKEN_IDS["<|im_start|>"], 8, 9]]
    alone_text = [llm.generate(t, params).outputs[0].token_ids for t in text]
    outs = llm.generate([prompts[0], text[0], prompts[1], text[1]], params)
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], [a, b])
    assert outs[2].outputs[0].token_ids == hf_greedy(hf, prompts[1], [b])
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone_text


def test_chunked_prefill_across_the_audio_placeholders(checkpoint, hf):
    """Prefill chunks of 16 tokens cut the clip's 22 placeholders: the output is still HF's."""
    from trtedge import LLM, SamplingParams

    clip = tone(1.6, seed=6)
    messages = user("w1 w2 w3", clip, "w4")
    with LLM(
        str(checkpoint),
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_num_batched_tokens=16,
        dtype="float32",
    ) as small:
        prompt = small.encode_prompt(messages)
        first = prompt.ids.index(AUDIO)
        assert first % 16 != 0 and prompt.ids.count(AUDIO) > 16
        out = small.chat(messages, SamplingParams(**GREEDY))
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, [clip])
        assert small.get_mm_embedding_cache_metrics()["encoded_items"] == 1


def test_repeated_clip_is_encoded_once_and_reuses_the_prefix(llm):
    from trtedge import SamplingParams

    clip = tone(1.1, seed=7)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = llm.get_mm_embedding_cache_metrics()["encoded_items"]
    first = llm.chat(user(clip, "w9"), params)
    second = llm.chat(user(clip, "w9"), params)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert llm.get_mm_embedding_cache_metrics()["encoded_items"] == before + 1
    other = llm.encode_prompt(user(tone(1.1, seed=8), "w9"))
    assert other.ids == llm.encode_prompt(user(clip, "w9")).ids  # same tokens, other audio
    assert other.items[0].hash != llm.encode_prompt(user(clip, "w9")).items[0].hash


def test_refusals(llm, checkpoint):
    with pytest.raises(ValueError, match="no vision component"):
        from PIL import Image

        llm.encode_prompt(
            [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (8, 8))}]}]
        )
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*1D numpy array"):
        llm.encode_prompt(user(np.zeros((2, 100), np.float32)))


def test_text_only_load_refuses_audio(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=128, max_input_len=64, components="llm") as text:
        assert text.audio is None
        with pytest.raises(ValueError, match="no audio component"):
            text.encode_prompt(user(tone(0.5)))


def test_audio_names_the_encoder_component():
    from trtedge.runtime.artifacts.bundle import BuildProfile

    assert BuildProfile.create(components="llm,audio").components == ("llm", "vision")
    asr = {"model_type": "qwen3_asr", "audio_config": {}}
    assert BuildProfile.create(components="all").fit(asr).components == ("llm", "vision")
    assert BuildProfile.create(components="all").fit({"model_type": "qwen3"}).components == ("llm",)


def test_int8_weights_leave_the_audio_encoder_float(llm, checkpoint, tmp_path):
    from trtedge import LLM, SamplingParams

    item = llm.audio.audio(tone(1.2, seed=2))
    ref = llm.model.audio(item.pixels, [item.grid])
    with LLM(
        str(checkpoint), max_kv_cache_capacity=128, max_input_len=64, weights="int8", cache_dir=str(tmp_path)
    ) as q:
        torch.testing.assert_close(q.model.audio(item.pixels, [item.grid]), ref, atol=0, rtol=0)
        assert (
            len(
                q.chat(
                    user(tone(1.2, seed=2), "w1"),
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                )
                .outputs[0]
                .token_ids
            )
            == 3
        )
