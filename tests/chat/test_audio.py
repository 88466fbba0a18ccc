"""`trtedge chat` /audio PATH: the file goes with the next message as an OpenAI input_audio part; the
local backend decodes it for the model (a tiny random Qwen3-ASR), whose answer equals the engine's
own for the same clip."""

from __future__ import annotations

import pytest

from trtedge.chat.backends import LocalBackend
from trtedge.chat.session import ChatSession
from trtedge.runtime.sampling_params import SamplingParams

pytest.importorskip("av")
tiny_asr = pytest.importorskip("tests.tiny_asr")


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("audio") / "clip.flac"
    path.write_bytes(tiny_asr.encode_clip(tiny_asr.tone(1.2, seed=3), "flac"))
    return path


def test_audio_attaches_to_the_next_message_only(clip_file, tmp_path):
    session = ChatSession()
    assert not session.execute(f"/audio {clip_file}").error
    session.add_user("w1 w2")
    session.add_user("w3")
    first, second = session.messages
    assert [p["type"] for p in first["content"]] == ["input_audio", "text"]
    assert first["content"][0]["input_audio"]["format"] == "flac" and second["content"] == "w3"
    text = tmp_path / "notes.txt"
    text.write_text("not audio")
    for arg in (str(text), str(tmp_path / "missing.wav")):
        assert session.execute(f"/audio {arg}").error
    session.execute(f"/audio {clip_file}")
    assert "dropped" in session.execute("/audio none").message and not session.attachments
    saved = session.transcript()
    again = ChatSession()
    again.load_transcript(saved)  # a saved conversation with audio loads back
    assert again.messages == session.messages


def test_local_backend_hears_the_clip(clip_file, tmp_path_factory):
    from trtedge import LLM
    from trtedge.runtime.multimodal.audio_file import decode_audio_file

    checkpoint = tiny_asr.make_tiny_qwen3_asr(tmp_path_factory.mktemp("asr"))
    with LLM(str(checkpoint), max_kv_cache_capacity=256, max_input_len=200) as llm:
        session = ChatSession()
        session.execute(f"/audio {clip_file}")
        session.add_user("w1 w2")
        params = SamplingParams(max_tokens=6, temperature=0)
        stream = LocalBackend(llm).stream(session.conversation(), params)
        text = "".join(c.text for c in stream)
        samples = decode_audio_file(clip_file.read_bytes(), 600.0)
        audio = [
            {
                "role": "user",
                "content": [{"type": "audio", "audio": samples}, {"type": "text", "text": "w1 w2"}],
            }
        ]
        assert text == llm.chat(audio, params).outputs[0].text
        metrics = stream.wait_metrics(5)
        assert metrics.prompt_tokens >= llm.audio.audio_tokens(samples.size)
