"""Qwen3-Omni's speech output against HF transformers on a tiny random checkpoint: the bundle's
speech components, the Talker's and code predictor's greedy codes, Code2Wav's waveform (whole and
in chunks), and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tiny_omni import IDS, make_tiny_qwen3_omni_speech

transformers = pytest.importorskip("transformers")

PROMPT = [IDS["<|im_start|>"], IDS["user"], 5, 6, 7, IDS["<|im_end|>"], IDS["<|im_start|>"], IDS["assistant"]]
FRAMES = 19


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_omni_speech(tmp_path_factory.mktemp("qwen3_omni_speech"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """HF's whole pipeline, greedy: the thinker's 8 tokens, the Talker's codes (FRAMES frames) and the
    waveform, plus the model (for its chunked decode)."""
    from tests.tiny_omni import load_hf

    hf = load_hf(checkpoint)
    captured = {}
    decode = hf.code2wav.chunked_decode

    def capture(codes, **kw):
        captured["codes"] = codes.clone()
        return decode(codes, **kw)

    hf.code2wav.chunked_decode = capture
    seq, wav = hf.generate(
        torch.tensor([PROMPT]),
        speaker="chelsie",
        thinker_max_new_tokens=8,
        thinker_eos_token_id=IDS["<|im_end|>"],
        thinker_do_sample=False,
        talker_max_new_tokens=FRAMES + 1,
        talker_do_sample=False,
    )
    return hf, seq[0].tolist(), captured["codes"][0], wav[0, 0]


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=256, max_input_len=128, dtype="float32") as llm:
        yield llm


GREEDY = dict(talker_temperature=0.0, max_audio_length=FRAMES / 12.5)


def test_the_bundle_holds_the_speech_components_and_llm_leaves_them_out(llm, checkpoint, tmp_path):
    from trtedge import LLM

    assert {"talker", "code_predictor", "code2wav"} <= set(llm.bundle.manifest["components"])
    assert llm.voices == ["aiden", "chelsie", "ethan"]
    assert llm.speech_output.sample_rate == 24000
    with LLM(str(checkpoint), max_kv_cache_capacity=256, max_input_len=128, components="llm") as text:
        assert text.speech_output is None and text.voices == []
        assert not {"talker", "code2wav"} & set(text.bundle.manifest["components"])
        with pytest.raises(ValueError, match="no speech output"):
            text.speech("w5 w6")


def test_greedy_codes_and_waveform_match_hf(llm, reference):
    from trtedge import SamplingParams
    from trtedge.runtime.speech.api import SpeechOptions, answer_ids

    hf, sequence, codes, wav = reference
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    assert PROMPT + out.token_ids == sequence  # the thinker's answer, as HF's
    # HF speaks the answer without its last token (an end of turn, or the 8th token here)
    ids = answer_ids(PROMPT, out.token_ids[:-1], llm.tokenizer.eos_token_ids)
    speech = llm.speech_output
    prompt = speech.prompt(ids, "chelsie")
    frames = list(speech.frames(prompt, SpeechOptions(**GREEDY).sampling(12.5)))
    assert torch.tensor(frames).T.tolist() == codes.tolist()
    whole = np.concatenate(
        list(llm.speech_stream(token_ids=ids, voice="chelsie", codec_chunk_frames=300, **GREEDY))
    )
    assert whole.shape == tuple(wav.shape)
    assert np.abs(wav.numpy()).max() < 0.99  # nothing hidden by the clamp
    np.testing.assert_allclose(whole, wav.numpy(), atol=1e-4, rtol=0)
    # streamed in chunks of 5 frames, each piece as soon as its frames are made: they concatenate to
    # the whole (HF's chunked decode drops each chunk's last tail samples; ours carry them on)
    pieces = list(llm.speech_stream(token_ids=ids, voice="chelsie", codec_chunk_frames=5, **GREEDY))
    tail, per_frame = speech.code2wav.tail, speech.cfg.samples_per_frame
    assert whole.shape[0] == FRAMES * per_frame - tail
    assert [p.shape[0] for p in pieces] == [5 * per_frame - tail, 5 * per_frame, 5 * per_frame, 4 * per_frame]
    np.testing.assert_allclose(np.concatenate(pieces), wav.numpy(), atol=1e-4, rtol=0)
    ref = hf.code2wav.chunked_decode(codes[None], chunk_size=5, left_context_size=25)[0, 0].detach().numpy()
    kept = np.concatenate([p[tail if i else 0 :] for i, p in enumerate(pieces)])
    np.testing.assert_allclose(kept, ref, atol=1e-4, rtol=0)  # HF's samples, where it has them


def test_text_to_speech_and_its_refusals(llm):
    from trtedge.runtime.speech.pipeline import SpeechInputError

    out = llm.speech("w5 w6 w7", voice="Ethan", talker_temperature=0.0, max_audio_length=0.8)
    assert out.sample_rate == 24000 and out.audio.dtype == np.float32
    assert 0 < out.audio.shape[0] <= 10 * 1920
    again = llm.speech("w5 w6 w7", voice="ethan", talker_temperature=0.0, max_audio_length=0.8)
    np.testing.assert_array_equal(out.audio, again.audio)
    sampled = [llm.speech("w5 w6 w7", seed=s, max_audio_length=0.8).audio for s in (1, 1)]
    np.testing.assert_array_equal(*sampled)
    cases = [
        (dict(voice="alloy"), "voice", "unknown voice 'alloy'"),
        (dict(talker_temperature=-1), "talker_temperature", "talker_temperature must be"),
        (dict(talker_top_p=0), "talker_top_p", "talker_top_p"),
        (dict(codec_chunk_frames=0), "codec_chunk_frames", "codec_chunk_frames"),
        (dict(max_audio_length=0), "max_audio_length", "max_audio_length"),
        (dict(talker_prefill_threshold=0), "talker_prefill_threshold", "talker_prefill_threshold"),
        (dict(repetition_penalty="x"), "repetition_penalty", "repetition_penalty"),
        (dict(bogus=1), "bogus", "unknown speech option"),
    ]
    for kw, param, message in cases:
        with pytest.raises(SpeechInputError, match=message) as e:
            llm.speech("w5", **kw)
        assert e.value.param == param
    with pytest.raises(SpeechInputError) as e:
        llm.speech("   ")
    assert e.value.param == "input"
    audio = [
        IDS["<|im_start|>"],
        IDS["user"],
        IDS["<|AUDIO|>"],
        IDS["<|im_end|>"],
        IDS["<|im_start|>"],
        IDS["assistant"],
        5,
        6,
    ]
    with pytest.raises(SpeechInputError) as e:
        llm.speech_stream(token_ids=audio)
    assert e.value.param == "modalities"


def test_live_speech_starts_before_the_text_is_complete_and_equals_the_whole(llm, reference):
    """The Talker speaks while the answer's tokens still arrive: its first piece of audio comes before
    the rest of the text is pushed, and the whole is the speech of the complete text."""
    import queue
    import threading

    from trtedge.runtime.speech.api import answer_ids

    _, sequence, _, _ = reference
    answer = sequence[len(PROMPT) :]
    eos = set(llm.tokenizer_info().eos_token_ids)
    options = dict(voice="chelsie", codec_chunk_frames=1, **GREEDY)
    whole = list(llm.speech_stream(token_ids=answer_ids(PROMPT, answer[:-1], eos), **options))
    live = llm.speech_live(PROMPT, talker_prefill_threshold=2, **options)
    got: queue.Queue = queue.Queue()
    worker = threading.Thread(target=lambda: [got.put(p) for p in live.pieces()] + [got.put(None)])
    worker.start()
    try:
        live.push(answer[:2])  # the threshold: the Talker starts
        first = got.get(timeout=30)  # audio before the rest of the text exists
        live.push(answer[2:-1])
        live.finish()
        pieces = [first]
        while (piece := got.get(timeout=30)) is not None:
            pieces.append(piece)
    finally:
        live.close()
        worker.join(30)
    assert len(pieces) == len(whole) == FRAMES
    np.testing.assert_allclose(np.concatenate(pieces), np.concatenate(whole), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="talker_prefill_threshold"):
        llm.speech_live(PROMPT, talker_prefill_threshold=0)
