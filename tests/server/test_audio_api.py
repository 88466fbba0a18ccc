"""Audio through the HTTP API in process, on a tiny random Qwen3-ASR: POST /v1/audio/transcriptions
(multipart, json / text / streamed answers equal to the engine's own greedy transcript of the same
prompt) and every refusal with its status, each leaving no seat or KV block held."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

pytest.importorskip("av")
tiny_asr = pytest.importorskip("tests.tiny_asr")

TRANSCRIBE = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_asr.make_tiny_qwen3_asr(tmp_path_factory.mktemp("tiny-asr"))


def _load(tmp_path_factory, checkpoint, **kwargs):
    from trtedge import LLM

    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    return LLM(str(checkpoint), cache_dir=str(cache), max_kv_cache_capacity=256, max_input_len=200, **kwargs)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, checkpoint):
    with _load(tmp_path_factory, checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def wav():
    return tiny_asr.encode_clip(tiny_asr.tone(1.5, seed=1), "wav")


def send(app, data: dict | None = None, files: dict | None = None, **kw) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(TRANSCRIBE, data=data, files=files, **kw)

    return asyncio.run(main())


def upload(clip: bytes, name: str = "clip.wav", mime: str = "audio/wav") -> dict:
    return {"file": (name, clip, mime)}


def assert_clean(app, llm) -> None:
    """No seat held, every KV block free (context reuse is off: nothing stays cached)."""
    stats = llm.stats()
    assert app.state.admission.num_active == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["active_requests"] == 0


def engine_transcript(llm, samples, language: str | None = None, max_tokens: int = 16) -> str:
    """What the engine itself answers to the transcription prompt, greedily."""
    from trtedge import SamplingParams
    from trtedge.runtime.multimodal.transcription import TranscriptReader, transcription_prompt

    tp = transcription_prompt(samples, None, language)
    prompt = llm.encode_prompt(tp.messages)
    ids = prompt.ids + llm.tokenizer.encode(tp.prefill, add_special_tokens=False)
    import dataclasses

    out = llm.generate(
        dataclasses.replace(prompt, ids=ids), SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    reader = TranscriptReader(header_done=language is not None)
    reader.feed(out.outputs[0].text)
    reader.finish()
    return reader.text.strip()


def decoded(clip: bytes):
    from trtedge.server.audio import decode_audio

    return decode_audio(clip, "file", 600.0)


def test_json_and_text_equal_the_engine_transcript(llm, wav):
    app = build_app(llm, ServeConfig(override_generation_config='{"max_new_tokens": 16}'))
    r = send(app, {"model": llm.model_name}, upload(wav))
    assert r.status_code == 200, r.text
    body = r.json()
    samples = decoded(wav)
    assert body["text"] == engine_transcript(llm, samples) and body["text"]
    usage = body["usage"]
    assert usage["type"] == "tokens" and usage["output_tokens"] == 16
    assert usage["input_token_details"]["audio_tokens"] == llm.audio.audio_tokens(samples.size)
    assert usage["total_tokens"] == usage["input_tokens"] + 16
    r = send(app, {"response_format": "text", "language": "en"}, upload(wav))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == engine_transcript(llm, samples, "en") + "\n"
    assert_clean(app, llm)


def test_language_is_written_into_the_prompt(llm, wav):
    app = build_app(llm, ServeConfig(override_generation_config='{"max_new_tokens": 2}'))
    plain = send(app, {}, upload(wav)).json()["usage"]["input_tokens"]
    english = send(app, {"language": "English"}, upload(wav)).json()["usage"]["input_tokens"]
    assert english - plain == len(
        llm.tokenizer.encode("language English<asr_text>", add_special_tokens=False)
    )
    assert_clean(app, llm)


def test_stream_sends_deltas_then_done(llm, wav):
    app = build_app(llm, ServeConfig(override_generation_config='{"max_new_tokens": 12}'))
    r = send(app, {"stream": "true", "language": "en"}, upload(wav))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e for e in events if e["type"] == "transcript.text.delta"]
    [done] = [e for e in events if e["type"] == "transcript.text.done"]
    assert events[-1] is done and deltas
    assert "".join(d["delta"] for d in deltas).strip() == done["text"]
    assert done["text"] == engine_transcript(llm, decoded(wav), "en", 12)
    assert done["usage"]["output_tokens"] == 12
    assert_clean(app, llm)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "ogg", "m4a", "webm"])
def test_other_containers_decode_to_the_same_length(wav, fmt):
    clip = tiny_asr.tone(1.5, seed=1)
    samples = decoded(tiny_asr.encode_clip(clip, fmt))
    assert abs(samples.size - clip.size) <= 0.2 * 16000  # codec priming / frame padding only
    stereo = decoded(tiny_asr.encode_clip(clip, "wav", rate=44100, channels=2))
    assert abs(stereo.size - clip.size * 16000 // 44100) <= 2  # resampled to 16 kHz mono


@pytest.mark.parametrize(
    ("config", "data", "files", "status", "code", "param"),
    [
        ({"max_audio_bytes": 1000}, {}, "wav", 413, "audio_too_large", "file"),
        ({"max_audio_bytes": 1000}, {}, "big", 413, "request_too_large", None),  # never read whole
        ({"max_audio_seconds": 1.0}, {}, "wav", 400, "audio_too_long", "file"),
        ({}, {}, "corrupt", 400, "invalid_audio", "file"),
        ({}, {}, "png", 400, "invalid_audio", "file"),
        ({}, {}, None, 400, "missing", "file"),
        ({}, {"response_format": "srt"}, "wav", 400, "unsupported_value", "response_format"),
        ({}, {"response_format": "xml"}, "wav", 400, "invalid_value", "response_format"),
        ({}, {"language": "tlh"}, "wav", 400, "invalid_value", "language"),
        ({}, {"temperature": "1.5"}, "wav", 400, None, "temperature"),
        ({}, {"stream": "maybe"}, "wav", 400, None, "stream"),
        ({}, {"model": "other"}, "wav", 404, "model_not_found", "model"),
        ({}, {"speed": "2"}, "wav", 400, "unknown_field", "speed"),
        ({}, {}, "traversal", 200, None, None),  # the file name is never used as a path
    ],
)
def test_refusals_hold_nothing(llm, wav, config, data, files, status, code, param):
    app = build_app(llm, ServeConfig(override_generation_config='{"max_new_tokens": 2}', **config))
    clips = {
        "wav": upload(wav),
        "corrupt": upload(wav[:44] + bytes(range(256)) * 8),
        "png": upload(b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "x.png", "image/png"),
        "traversal": upload(wav, "../../../../etc/passwd"),
        "big": upload(wav * 25),
        None: {"language": (None, "en")},  # multipart, but no file part
    }
    r = send(app, data or {"prompt": "w1"}, clips[files])
    assert r.status_code == status, r.text
    if status != 200:
        error = r.json()["error"]
        assert error["param"] == param and (code is None or error["code"] == code)
    assert_clean(app, llm)


def test_not_multipart_is_a_400(llm):
    app = build_app(llm)
    r = send(app, json={"file": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    assert_clean(app, llm)


def test_a_model_without_audio_refuses(tmp_path_factory, checkpoint, wav):
    with _load(tmp_path_factory, checkpoint, components="llm") as text_only:
        app = build_app(text_only)
        r = send(app, {}, upload(wav))
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_audio_component"
        assert_clean(app, text_only)


# ---- audio parts in chat (OpenAI input_audio / audio_url) and Responses (input_audio) --------------------
def post(app, path: str, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat(*parts: dict, max_tokens: int = 6) -> dict:
    content = [{"type": "text", "text": "w1 w2"}, *parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def test_chat_input_audio_answers_as_the_engine_does(llm, wav):
    from trtedge import SamplingParams

    app = build_app(llm)
    r = post(app, "/v1/chat/completions", chat(input_audio(wav)))
    assert r.status_code == 200, r.text
    samples = decoded(wav)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "w1 w2"}, {"type": "audio", "audio": samples}]}
    ]
    expected = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0))
    assert r.json()["choices"][0]["message"]["content"] == expected.outputs[0].text
    plain = post(app, "/v1/chat/completions", chat()).json()["usage"]["prompt_tokens"]
    grown = r.json()["usage"]["prompt_tokens"] - plain
    assert grown == llm.audio.audio_tokens(samples.size) + 2  # + <|audio_start|> <|audio_end|>
    # the same clip as an audio_url data URL, and through the Responses API
    r2 = post(app, "/v1/chat/completions", chat(audio_url(f"data:audio/wav;base64,{b64(wav)}")))
    assert r2.json()["choices"][0]["message"]["content"] == expected.outputs[0].text
    content = [{"type": "input_text", "text": "w1 w2"}, input_audio(wav)]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 6, "temperature": 0}
    r3 = post(app, "/v1/responses", body)
    assert r3.status_code == 200, r3.text
    assert r3.json()["output"][0]["content"][0]["text"] == expected.outputs[0].text
    assert_clean(app, llm)


def test_chat_audio_files_are_confined_to_the_media_directory(llm, wav, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "clip.wav").write_bytes(wav)
    (tmp_path / "secret.wav").write_bytes(wav)
    app = build_app(llm, ServeConfig(allowed_local_media_path=str(media)))
    assert post(app, "/v1/chat/completions", chat(audio_url(str(media / "clip.wav")))).status_code == 200
    for url, status in (("../secret.wav", 403), (str(tmp_path / "secret.wav"), 403), ("missing.wav", 404)):
        r = post(app, "/v1/chat/completions", chat(audio_url(url)))
        assert r.status_code == status and r.json()["error"]["param"] == "messages.0.content.1.audio_url"
    r = post(build_app(llm), "/v1/chat/completions", chat(audio_url("https://example.com/a.wav")))
    assert r.status_code == 403 and r.json()["error"]["code"] == "remote_media_forbidden"
    assert_clean(app, llm)


@pytest.mark.parametrize(
    ("config", "part", "status", "code", "param"),
    [
        ({"max_audio_bytes": 1000}, "wav", 413, "media_too_large", "messages.0.content.1.input_audio"),
        ({"max_audio_seconds": 1.0}, "wav", 400, "audio_too_long", "messages.0.content.1.input_audio"),
        ({}, "corrupt", 400, "invalid_audio", "messages.0.content.1.input_audio"),
        ({}, "aiff", 400, "invalid_value", "messages.0.content.1.input_audio.format"),
        ({}, "image", 400, "no_vision_component", "messages.0.content.1.image_url"),
    ],
)
def test_chat_audio_refusals_hold_nothing(llm, wav, config, part, status, code, param):
    app = build_app(llm, ServeConfig(**config))
    parts = {
        "wav": input_audio(wav),
        "corrupt": input_audio(b"RIFF\0\0\0\0WAVE" + bytes(200)),
        "aiff": input_audio(wav, "aiff"),
        "image": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    }
    r = post(app, "/v1/chat/completions", chat(parts[part]))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    if config.get("max_audio_bytes"):
        assert "--max-audio-bytes 1000" in error["message"]
    assert_clean(app, llm)


def test_chat_audio_to_a_model_without_audio_is_a_400(tmp_path_factory, checkpoint, wav):
    with _load(tmp_path_factory, checkpoint, components="llm") as text_only:
        app = build_app(text_only)
        r = post(app, "/v1/chat/completions", chat(input_audio(wav)))
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_audio_component"
        assert r.json()["error"]["param"] == "messages.0.content.1.input_audio"
        assert_clean(app, text_only)


def test_a_clip_over_max_input_len_is_refused_before_a_seat(llm):
    long = tiny_asr.encode_clip(tiny_asr.tone(16.0, seed=5), "wav")  # 208 placeholder tokens > 200
    app = build_app(llm)
    r = send(app, {}, upload(long))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "file"
    r = post(app, "/v1/chat/completions", chat(input_audio(long)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages.0.content.1.input_audio"
    assert_clean(app, llm)


def test_an_omni_thinker_transcribes_by_instruction(tmp_path_factory, wav):
    from trtedge import LLM, SamplingParams
    from trtedge.runtime.multimodal.transcription import transcription_prompt

    omni = tiny_asr.make_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny-omni"))
    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    with LLM(str(omni), cache_dir=str(cache), max_kv_cache_capacity=256, max_input_len=200) as llm:
        app = build_app(llm, ServeConfig(override_generation_config='{"max_new_tokens": 8}'))
        r = send(app, {"language": "de"}, upload(wav))
        assert r.status_code == 200, r.text
        tp = transcription_prompt(decoded(wav), None, "de", "instruct")
        assert tp.messages[-1]["content"][1]["text"] == "Transcribe the German audio into text."
        expected = llm.chat(tp.messages, SamplingParams(max_tokens=8, temperature=0)).outputs[0].text
        assert r.json()["text"] == expected.strip()
        assert_clean(app, llm)


def test_transcriptions_need_the_api_key_and_are_counted(llm, wav):
    app = build_app(llm, ServeConfig(api_key="sekrit", override_generation_config='{"max_new_tokens": 2}'))
    assert send(app, {}, upload(wav)).status_code == 401
    ok = send(app, {}, upload(wav), headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200, ok.text

    async def metrics():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/metrics", headers={"Authorization": "Bearer sekrit"})).text

    text = asyncio.run(metrics())
    assert 'endpoint="/v1/audio/transcriptions",status="200"' in text
    assert_clean(app, llm)
