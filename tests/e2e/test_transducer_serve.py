"""`trtedge serve` of a tiny random Nemotron-3.5-ASR (an RNN-T transcriber), driven by the official
openai SDK: ``audio.transcriptions.create`` (json, text, streamed) gives the same greedy transcript
each time; a prompt is refused naming the field; chat completions say the model only transcribes."""

from __future__ import annotations

import pytest

from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("av")
pytest.importorskip("transformers")
tiny = pytest.importorskip("tests.tiny_nemotron_asr")
tiny_asr = pytest.importorskip("tests.tiny_asr")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = tiny.make_tiny_nemotron_asr(tmp_path_factory.mktemp("nemotron-asr"))
    server = ServeProcess(
        tmp_path_factory, [str(checkpoint), "--max-input-len", "200", "--log-level", "warning"]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_sdk_transcribes_and_refuses(client, server):
    model = client.models.list().data[0].id
    clip = ("clip.mp3", tiny_asr.encode_clip(tiny.clip(0), "mp3"))
    first = client.audio.transcriptions.create(model=model, file=clip, language="de")
    assert first.text and first.usage.input_token_details.audio_tokens == first.usage.input_tokens > 0
    text = client.audio.transcriptions.create(model=model, file=clip, language="de", response_format="text")
    assert text.strip() == first.text
    events = list(client.audio.transcriptions.create(model=model, file=clip, language="de", stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert "".join(deltas) == first.text and events[-1].type == "transcript.text.done"
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model=model, file=clip, prompt="names: w1")
    assert refused.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert chat.value.body["code"] == "transcription_only"
    engine = server.health()["engine"]
    assert engine["running"] == engine["waiting"] == 0
