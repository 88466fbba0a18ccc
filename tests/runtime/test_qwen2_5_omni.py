"""Qwen2.5-Omni's thinker with audio against HF transformers on a tiny random checkpoint: Whisper's
log-mel front end, the audio encoder, and greedy generation through ``LLM`` (HF fed its own features
and positions), alone, batched with a text request and under chunked prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.test_qwen3_asr import GREEDY, user
from tests.tiny_asr import TOKEN_IDS, make_tiny_qwen2_5_omni, tone

transformers = pytest.importorskip("transformers")

AUDIO = TOKEN_IDS["<|AUDIO|>"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen2_5_omni(tmp_path_factory.mktemp("qwen2_5_omni"))


def load_hf(checkpoint):
    """HF's thinker of ``checkpoint`` in float32."""
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    )
    for module in model.modules():  # the thinker's rotary index reads it (there is no image here)
        config = getattr(module, "config", None)
        if isinstance(config, transformers.Qwen2_5OmniThinkerConfig):
            config.vision_start_token_id = TOKEN_IDS["<|endoftext|>"] + 100
    return model.eval()


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=512, max_input_len=400, dtype="float32") as llm:
        yield llm


def hf_features(clips: list[np.ndarray]) -> dict:
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    out = fe(
        clips, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt"
    )
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


def hf_greedy(hf, ids: list[int], clips: list[np.ndarray]) -> list[int]:
    """HF's greedy continuation of our prompt ids with its own features of the clips (and its own
    rotary positions)."""
    ids_t = torch.tensor([ids])
    out = hf.generate(
        input_ids=ids_t,
        attention_mask=torch.ones_like(ids_t),
        **hf_features(clips),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
    )
    return out[0, ids_t.shape[1] :].tolist()


@pytest.mark.parametrize("seconds", [0.3, 1.0, 1.6, 2.55])
def test_whisper_log_mel_matches_hf(llm, seconds):
    clip = tone(seconds, seed=int(seconds * 10))
    ref = hf_features([clip])
    frames = int(ref["feature_attention_mask"].sum())
    got = llm.audio.features(clip)
    assert got.shape == (frames, 128)
    torch.testing.assert_close(got.T, ref["input_features"][0, :, :frames], atol=1e-5, rtol=0)
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    assert llm.audio.audio_tokens(clip.size) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))


def test_audio_encoder_matches_hf(llm, hf):
    clips = [tone(1.6, seed=0), tone(0.7, seed=1), tone(2.55, seed=2)]  # 100-frame chunks cut two
    items = [llm.audio.audio(c) for c in clips]
    feats = hf_features(clips)
    with torch.no_grad():
        ref = hf.model.get_audio_features(**feats).last_hidden_state
    got = llm.model.audio(torch.cat([it.pixels for it in items]), [it.grid for it in items])
    assert got.shape[0] == sum(it.num_tokens for it in items)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_greedy_alone_batched_and_chunked_matches_hf(llm, hf, checkpoint):
    from trtedge import LLM, SamplingParams

    a, b = tone(1.6, seed=3), tone(1.1, seed=5, freq=600)
    one, two = user("w5 w6", a, "w7 w8 w9"), user("w3", a, "w4", b)
    prompts = [llm.encode_prompt(m) for m in (one, two)]
    assert prompts[0].positions is None and prompts[0].ids.count(AUDIO) == llm.audio.audio_tokens(a.size)
    expected = [hf_greedy(hf, prompts[0].ids, [a]), hf_greedy(hf, prompts[1].ids, [a, b])]
    text = [TOKEN_IDS["<|im_start|>"], 5, 6, 7]
    params = SamplingParams(**GREEDY)
    outs = llm.generate([prompts[0], text, prompts[1]], params)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert outs[1].outputs[0].token_ids == llm.generate(text, params).outputs[0].token_ids
    other = llm.chat(user("w5 w6", tone(1.6, seed=9, freq=200), "w7 w8 w9"), params)
    assert other.outputs[0].token_ids != expected[0]  # the clip, not only its length, counts
    with LLM(str(checkpoint), max_kv_cache_capacity=256, max_num_batched_tokens=16, dtype="float32") as small:
        assert small.chat(one, params).outputs[0].token_ids == expected[0]


def test_clips_over_30_seconds_are_refused(llm):
    with pytest.raises(ValueError, match="at most 30 s"):
        llm.encode_prompt(user(np.zeros(16000 * 31, np.float32)))


def test_a_whole_omni_checkpoint_serves_its_thinker(tmp_path, llm):
    """config qwen2_5_omni with thinker_config and thinker.* tensors: the same answers as the thinker
    alone; an int8 bundle converts the thinker's decoder and leaves the talker out."""
    from safetensors import safe_open

    from tests.tiny_asr import make_tiny_qwen2_5_omni_full
    from trtedge import LLM, SamplingParams

    full = make_tiny_qwen2_5_omni_full(tmp_path / "omni")
    messages = user("w5 w6", tone(1.6, seed=3), "w7")
    params = SamplingParams(**GREEDY)
    with LLM(str(full), max_kv_cache_capacity=256, dtype="float32", cache_dir=str(tmp_path / "c")) as whole:
        assert (
            whole.chat(messages, params).outputs[0].token_ids
            == llm.chat(messages, params).outputs[0].token_ids
        )
    with LLM(str(full), max_kv_cache_capacity=256, weights="int8", cache_dir=str(tmp_path / "c")) as q:
        assert q.audio is not None
        names = set()
        for shard in q.bundle.path.rglob("*.safetensors"):
            with safe_open(shard, "pt") as f:
                names.update(f.keys())
    assert any(n.startswith("thinker.model.layers.") for n in names)  # converted (the encoder stays
    assert not any(n.startswith(("talker.", "thinker.audio_tower.")) for n in names)  # in the checkpoint)
