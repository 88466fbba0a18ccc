"""`trtedge serve` on a tiny random Qwen3-Omni with speech output, driven by the official openai SDK:
``audio.speech.create`` (a WAV that Python's ``wave`` module reads with the right rate and length, and
that sox reads where it is installed) and ``with_streaming_response`` (the PCM stream = the WAV's
samples); an unknown voice and an over-long input are 400s naming the field and hold nothing, and the
same checkpoint served without its speech components (``--components llm``) refuses speech naming
``model`` and audio chat naming ``modalities``."""

from __future__ import annotations

import io
import shutil
import subprocess
import wave

import pytest

from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("av")

SPEAK = {"talker_temperature": 0, "max_audio_length": 1.2, "codec_chunk_frames": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.tiny_omni import make_tiny_qwen3_omni_speech

    return make_tiny_qwen3_omni_speech(tmp_path_factory.mktemp("tiny-omni"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    args = [
        str(checkpoint),
        "--max-kv-cache-capacity",
        "256",
        "--max-input-len",
        "64",
        "--log-level",
        "warning",
    ]
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_sdk_speech_as_wav_and_as_a_pcm_stream(client, server, tmp_path):
    model = client.models.list().data[0].id
    assert server.health()["capabilities"]["speech_output"] is True
    wav = client.audio.speech.create(
        model=model, input="w5 w6 w7 w8", voice="aiden", response_format="wav", extra_body=SPEAK
    ).content
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        frames = w.getnframes()
        samples = w.readframes(frames)
    assert 0 < frames <= 15 * 1920 and len(samples) == 2 * frames
    if shutil.which("sox"):
        path = tmp_path / "speech.wav"
        path.write_bytes(wav)
        info = subprocess.run(["sox", "--i", str(path)], capture_output=True, text=True, check=True).stdout
        assert "24000" in info and f"{frames} samples" in info
    with client.audio.speech.with_streaming_response.create(
        model=model, input="w5 w6 w7 w8", voice="aiden", response_format="pcm", extra_body=SPEAK
    ) as reply:
        chunks = list(reply.iter_bytes())
    assert b"".join(chunks) == samples  # greedy: the same speech, streamed raw


def test_sdk_refusals_name_the_field(client, server):
    model = client.models.list().data[0].id
    for kw, param in (({"voice": "alloy"}, "voice"), ({"input": "w1 " * 100}, "input")):
        args = {"model": model, "input": "w5", "voice": "ethan", **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(**args)
        assert e.value.body["param"] == param
    engine = server.health()["engine"]
    assert engine["running"] + engine["waiting"] == 0
    assert server.health()["active_requests"] == 0


def test_served_without_a_talker_speech_is_refused_naming_the_model(tmp_path_factory, checkpoint):
    args = [
        str(checkpoint),
        "--components",
        "llm",
        "--max-kv-cache-capacity",
        "256",
        "--log-level",
        "warning",
    ]
    server = ServeProcess(tmp_path_factory, args)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        assert server.health()["capabilities"]["speech_output"] is False
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model=model, input="w5", voice="ethan")
        assert e.value.body["param"] == "model" and "no speech output" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "w5"}],
                modalities=["text", "audio"],
                audio={"voice": "ethan", "format": "wav"},
                max_tokens=2,
            )
        assert e.value.body["param"] == "modalities"
        assert client.with_options().get("/voices", cast_to=object)["data"] == []
    finally:
        server.stop()
