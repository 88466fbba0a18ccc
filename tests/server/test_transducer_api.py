"""A served RNN-T transcriber (tiny random Nemotron-3.5-ASR), in process: POST /v1/audio/transcriptions
answers json / text / streamed with the transcript ``LLM`` gives for the same clip; what a transducer
cannot do (a prompt, sampling, unknown languages, chat and completions) is refused with a 400 naming
the field, and nothing stays held."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from trtedge.runtime.multimodal.audio_file import decode_audio_file
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

pytest.importorskip("av")
pytest.importorskip("transformers")
tiny = pytest.importorskip("tests.tiny_nemotron_asr")
tiny_asr = pytest.importorskip("tests.tiny_asr")

TRANSCRIBE = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from trtedge import LLM

    checkpoint = tiny.make_tiny_nemotron_asr(tmp_path_factory.mktemp("nemotron-asr"))
    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    with LLM(str(checkpoint), cache_dir=str(cache), max_input_len=200) as llm:
        yield llm


@pytest.fixture(scope="module")
def wav():
    return tiny_asr.encode_clip(tiny.clip(0), "wav")


def request(app, method: str, path: str, **kw) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, **kw)

    return asyncio.run(main())


def send(app, data: dict | None = None, wav: bytes | None = None) -> httpx.Response:
    files = {"file": ("clip.wav", wav, "audio/wav")} if wav is not None else None
    return request(app, "POST", TRANSCRIBE, data=data, files=files)


def assert_clean(app, llm) -> None:
    assert app.state.admission.num_active == 0 and llm.stats()["active_requests"] == 0


def engine_text(llm, wav: bytes, language: str | None = None) -> str:
    samples = decode_audio_file(wav, 60.0)
    return llm.generate(llm.audio.prompt(samples, language), SamplingParams(max_tokens=1000)).text


def test_json_text_and_stream_equal_the_engine_transcript(llm, wav):
    app = build_app(llm)
    expected = engine_text(llm, wav, "de")
    assert expected
    r = send(app, {"language": "de"}, wav)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == expected
    frames = llm.audio.num_frames(len(tiny.clip(0)))
    assert body["usage"]["input_tokens"] == body["usage"]["input_token_details"]["audio_tokens"] == frames
    assert body["usage"]["output_tokens"] > 0
    assert send(app, {"language": "de", "response_format": "text"}, wav).text == expected + "\n"
    r = send(app, {"language": "de", "stream": "true"}, wav)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == expected
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == expected
    assert send(app, {}, wav).json()["text"] == engine_text(llm, wav)  # auto: the default prompt slot
    assert_clean(app, llm)


@pytest.mark.parametrize(
    ("data", "param", "code"),
    [
        ({"prompt": "w1 w2"}, "prompt", "unsupported_value"),
        ({"temperature": "0.5"}, "temperature", "unsupported_value"),
        ({"language": "tlh"}, "language", "invalid_value"),
        ({"response_format": "srt"}, "response_format", "unsupported_value"),
    ],
)
def test_what_a_transducer_refuses(llm, wav, data, param, code):
    app = build_app(llm)
    r = send(app, data, wav)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert_clean(app, llm)


def test_a_clip_over_max_input_len_is_refused(llm):
    app = build_app(llm, ServeConfig(max_audio_seconds=60.0))
    long = tiny_asr.encode_clip(tiny_asr.tone(20.0), "wav")  # 251 encoder frames > 200
    r = send(app, {}, long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert_clean(app, llm)


def test_a_clip_past_the_encoder_positions_is_refused(llm):
    app = build_app(llm, ServeConfig(max_audio_seconds=60.0))
    r = send(app, {}, tiny_asr.encode_clip(tiny_asr.tone(30.0), "wav"))  # 376 encoder frames > 300
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_audio"
    assert "at most 300" in r.json()["error"]["message"] and r.json()["error"]["param"] == "file"
    assert_clean(app, llm)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_generation_routes_say_the_model_only_transcribes(llm, path, body):
    app = build_app(llm)
    r = request(app, "POST", path, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "transcription_only" and TRANSCRIBE in error["message"]
    assert_clean(app, llm)


def test_anthropic_messages_refuse_in_anthropic_wording(llm):
    app = build_app(llm)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = request(app, "POST", "/v1/messages", json=body)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert TRANSCRIBE in r.json()["error"]["message"]


def test_health_and_models_still_answer(llm):
    app = build_app(llm)
    health = request(app, "GET", "/health").json()
    assert health["status"] == "ok" and health["capabilities"]["audio"] is True
    assert request(app, "GET", "/v1/models").json()["data"][0]["id"] == llm.model_name
