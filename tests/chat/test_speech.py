"""Speech in `trtedge chat`: /speak and /save-audio in the session, the loop speaking each answer once
(played with the player found, saved as a WAV that reads back), and both backends' speak()."""

from __future__ import annotations

import io
import json
import wave

import httpx
import numpy as np
import pytest

from tests.chat import test_app
from tests.chat.test_app import ScriptedBackend, _Stream
from trtedge.chat.backends import BackendError, HttpBackend, LocalBackend
from trtedge.chat.session import ChatSession

run = test_app.run  # the loop over a pipe (a fixture)
AUDIO = (0.5 * np.sin(np.arange(4800) / 7)).astype(np.float32)


class SpeakingBackend(ScriptedBackend):
    def __init__(self):
        super().__init__()
        self.spoken = []

    def speak(self, text, voice=None):
        self.spoken.append(text)
        return AUDIO


def test_speak_and_save_audio_commands():
    session = ChatSession()
    assert session.execute("/speak").message == "answers are not spoken"
    assert session.execute("/speak on").message == "answers are spoken" and session.speak
    assert session.execute("/speak loud").error
    assert session.execute("/save-audio").error
    assert "no answer yet" in session.execute("/save-audio a.wav").message
    session.add_user("hi")
    session.add_answer("hello")
    result = session.execute("/save-audio a.wav")
    assert (result.action, result.argument) == ("save-audio", "a.wav")


def test_the_loop_speaks_each_answer_once_and_saves_it(run, tmp_path, monkeypatch):
    played = []
    monkeypatch.setattr("trtedge.chat.tui.play", lambda audio: played.append(audio) and None)
    backend = SpeakingBackend()
    backend.answers = [_Stream([("Hello there.", False)]), _Stream([("Second.", False)])]
    path = tmp_path / "answer.wav"
    out = run(backend, f"/speak on\rhi\r/save-audio {path}\r/speak off\ragain\r/exit\r")
    assert backend.spoken == ["Hello there."]  # made once: /save-audio reuses it; not spoken when off
    assert len(played) == 1 and played[0] is AUDIO
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (24000, 1, AUDIO.shape[0])
    assert f"wrote {path}" in out


def test_a_backend_without_speech_says_so(run, tmp_path):
    backend = ScriptedBackend()

    def speak(text, voice=None):
        raise BackendError("scripted has no speech output")

    backend.speak = speak
    backend.answers = [_Stream([("Hello.", False)])]
    out = run(backend, f"hi\r/save-audio {tmp_path / 'x.wav'}\r/exit\r")
    assert "error: scripted has no speech output" in out and not (tmp_path / "x.wav").exists()


def test_http_backend_speaks_through_the_speech_route():
    pcm = (AUDIO * 32767).astype("<i2").tobytes()
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "omni"}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={"capabilities": {"max_model_len": 256}})
        seen.append(json.loads(request.content))
        if seen[-1].get("voice") == "alloy":
            return httpx.Response(400, json={"error": {"message": "unknown voice 'alloy'", "param": "voice"}})
        return httpx.Response(200, content=pcm, headers={"content-type": "audio/pcm"})

    backend = HttpBackend("http://t", transport=httpx.MockTransport(handler))
    audio = backend.speak("Hello.", "ethan")
    assert seen[0] == {"model": "omni", "input": "Hello.", "response_format": "pcm", "voice": "ethan"}
    np.testing.assert_allclose(audio, AUDIO, atol=1 / 16000)
    with pytest.raises(BackendError, match="unknown voice"):
        backend.speak("Hello.", "alloy")


def test_local_backend_speaks_with_the_llm():
    class FakeLLM:
        model_name = "m"
        config = type("C", (), {"max_kv_cache_capacity": 64})()
        speech_output = None

        def speech(self, text, voice=None):
            return type("S", (), {"audio": AUDIO})()

    llm = FakeLLM()
    with pytest.raises(BackendError, match="no speech output"):
        LocalBackend(llm).speak("hi")
    llm.speech_output = object()
    assert LocalBackend(llm).speak("hi") is AUDIO


def test_wav_bytes_read_back():
    from trtedge.chat.speech import wav_bytes

    with wave.open(io.BytesIO(wav_bytes(AUDIO))) as w:
        assert w.getnframes() == AUDIO.shape[0] and w.getsampwidth() == 2


def test_the_loop_speaks_and_saves_a_real_omni_answer(run, tmp_path, tmp_path_factory, monkeypatch):
    """`trtedge chat` on the tiny Qwen3-Omni: /speak on plays the Talker's audio of the answer and
    /save-audio writes those samples; Code2Wav's length (whole frames less its tail) shows it is speech."""
    pytest.importorskip("transformers")
    from tests.tiny_omni import make_tiny_qwen3_omni_speech
    from trtedge import LLM, SamplingParams
    from trtedge.runtime.speech.encode import pcm16

    checkpoint = make_tiny_qwen3_omni_speech(tmp_path_factory.mktemp("omni"))
    played = []
    monkeypatch.setattr("trtedge.chat.tui.play", lambda audio: played.append(audio) and None)
    path = tmp_path / "answer.wav"
    with LLM(str(checkpoint), max_kv_cache_capacity=256, max_input_len=128, dtype="float32") as llm:
        speak = llm.speech
        llm.speech = lambda text, voice=None: speak(
            text, voice=voice, max_audio_length=0.8
        )  # 10 frames at most
        backend = LocalBackend(llm)
        session = ChatSession(SamplingParams(max_tokens=6, temperature=0), max_context=backend.max_context)
        out = run(backend, f"/speak on\rw5 w6 w7\r/save-audio {path}\r/exit\r", session=session)
        tail, per_frame = llm.speech_output.code2wav.tail, llm.speech_output.cfg.samples_per_frame
    assert f"wrote {path}" in out and len(played) == 1
    audio = played[0]
    assert audio.dtype == np.float32 and audio.size > 0 and (audio.size + tail) % per_frame == 0
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.readframes(w.getnframes()) == pcm16(audio)
