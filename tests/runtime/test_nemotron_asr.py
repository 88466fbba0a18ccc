"""Nemotron-3.5-ASR (an RNN-T transcriber) against HF transformers on a tiny random checkpoint, on the
CPU in float32: the log-mel features, the encoder's joint-space frames, and greedy transducer decoding
through ``LLM`` (the HF processor's features, ``generate``'s tokens and decoded text)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtedge.runtime.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("tests.tiny_nemotron_asr")
CLIPS = {"short": tiny.clip(0), "long": np.concatenate([tiny.clip(1), tiny.clip(2)])}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_tiny_nemotron_asr(tmp_path_factory.mktemp("nemotron-asr"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.Nemotron3_5AsrForRNNT.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, checkpoint):
    from trtedge import LLM

    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    with LLM(str(checkpoint), cache_dir=str(cache), dtype="float32", device="cpu") as llm:
        yield llm


def hf_transcribe(hf, samples, language: str = "auto") -> tuple[list[int], str]:
    model, processor = hf
    inputs = processor(samples, sampling_rate=16000, language=language)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=2000)
    ids = [t for t in out.sequences[0, 1:].tolist() if t != tiny.BLANK]
    return ids, processor.batch_decode(out.sequences, skip_special_tokens=True)[0]


@pytest.mark.parametrize("num_samples", [16000, 12345, 800])
def test_features_equal_the_feature_extractor(llm, num_samples):
    samples = np.random.default_rng(num_samples).standard_normal(num_samples).astype(np.float32) * 0.1
    fe = transformers.NemotronAsrStreamingFeatureExtractor(feature_size=16)
    ref = fe(samples, sampling_rate=16000, return_tensors="pt")
    n = int(ref["attention_mask"].sum())
    got = llm.audio.features(samples)
    assert got.shape == (n, 16)
    assert torch.allclose(got, ref["input_features"][0, :n], atol=1e-4)


@pytest.mark.parametrize(("num_mel_frames", "prompt_id"), [(70, 3), (133, 5), (37, 0)])
def test_encoder_frames_equal_transformers(llm, hf, num_mel_frames, prompt_id):
    model = llm.engine.model
    feats = torch.randn(num_mel_frames, 16, generator=torch.Generator().manual_seed(num_mel_frames))
    with torch.no_grad():
        ref = hf[0].get_audio_features(
            input_features=feats[None], num_lookahead_tokens=2, prompt_ids=torch.tensor([prompt_id])
        )
    got = model.encode(feats, prompt_id, 2)
    assert got.shape[0] == model.num_frames(num_mel_frames) == ref.pooler_output.shape[1]
    assert torch.allclose(got, ref.pooler_output[0], atol=1e-4)


@pytest.mark.parametrize(("clip", "language"), [("short", None), ("short", "de"), ("long", "en-US")])
def test_greedy_transcript_equals_transformers(llm, hf, clip, language):
    samples = CLIPS[clip]
    ref_ids, ref_text = hf_transcribe(hf, samples, language or "auto")
    out = llm.generate(llm.audio.prompt(samples, language), SamplingParams(max_tokens=2000))
    assert out.token_ids == ref_ids and out.finish_reason == "stop"
    assert out.text == ref_text
    assert out.prompt_tokens == llm.audio.num_frames(len(samples))


def test_the_reference_decoding_exercises_blanks_and_forced_advances(llm, hf):
    """The fixture's weights make greedy decoding take every branch: frames left by a blank, frames that
    emit, and frames held until max_symbols_per_step forces a move."""
    samples = CLIPS["short"]
    ids, _ = hf_transcribe(hf, samples)
    frames = llm.audio.num_frames(len(samples))
    assert 0 < len(ids) < 3 * frames and len(set(ids)) > 2
    assert any(ids[i] == ids[i + 1] == ids[i + 2] for i in range(len(ids) - 2))


def test_max_tokens_bounds_the_transcript(llm):
    out = llm.generate(llm.audio.prompt(CLIPS["short"]), SamplingParams(max_tokens=4))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert llm.stats()["active_requests"] == 0


def test_what_a_transducer_refuses(llm):
    with pytest.raises(ValueError, match="RNN-T transcriber"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="^n is not supported"):
        llm.generate(llm.audio.prompt(CLIPS["short"][:8000]), SamplingParams(max_tokens=4, n=2))
    with pytest.raises(ValueError, match="language 'tlh'"):
        llm.audio.prompt(CLIPS["short"][:8000], "tlh")
    with pytest.raises(ValueError, match="shorter than one 10 ms frame"):
        llm.audio.prompt(np.zeros(100, dtype=np.float32))
    assert llm.stats()["active_requests"] == 0


def test_languages_come_from_the_processor_config(llm):
    audio = llm.audio
    assert audio.prompt_id(None) == 5 and audio.prompt_id("auto") == 5
    assert audio.prompt_id("de-DE") == audio.prompt_id("DE") == 1
    assert audio.lookahead == 2


def test_a_cancelled_stream_ends_and_frees_the_engine(llm):
    stream = llm.generate_stream(llm.audio.prompt(CLIPS["long"]), SamplingParams(max_tokens=1000))
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    stream.cancel()
    last = list(stream)[-1]
    assert last.finish_reason == "cancelled"
    assert llm.stats()["active_requests"] == 0 and llm.stats()["cancelled"] >= 1


def test_a_chat_of_one_clip_transcribes_as_the_prompt_does(llm):
    samples = CLIPS["short"]
    params = SamplingParams(max_tokens=1000)
    want = llm.generate(llm.audio.prompt(samples, "de"), params).token_ids
    clip = {"type": "audio", "audio": samples, "language": "de"}
    assert llm.chat([{"role": "user", "content": [clip]}], params).token_ids == want
    with pytest.raises(ValueError, match="takes one audio clip and nothing else"):
        llm.chat([{"role": "user", "content": [clip, {"type": "text", "text": "w1"}]}], params)
    with pytest.raises(ValueError, match="takes one audio clip and nothing else"):
        llm.chat([{"role": "user", "content": [clip, clip]}], params)


def test_the_english_only_predecessor_transcribes_as_transformers(tmp_path):
    """nemotron_asr_streaming: the same transducer without the language prompt."""
    from trtedge import LLM

    path = tiny.make_tiny_nemotron_asr(tmp_path / "m", streaming=True)
    model = transformers.NemotronAsrStreamingForRNNT.from_pretrained(path, dtype=torch.float32).eval()
    samples = CLIPS["long"]
    inputs = transformers.AutoProcessor.from_pretrained(path)(samples, sampling_rate=16000)
    with torch.no_grad():
        ref = [
            t
            for t in model.generate(**inputs, max_new_tokens=2000).sequences[0, 1:].tolist()
            if t != tiny.BLANK
        ]
    with LLM(str(path), cache_dir=str(tmp_path / "cache"), dtype="float32", device="cpu") as llm:
        out = llm.generate(llm.audio.prompt(samples), SamplingParams(max_tokens=2000))
        with pytest.raises(ValueError, match="no language prompt"):
            llm.audio.prompt(samples, "en")
    assert ref and out.token_ids == ref
