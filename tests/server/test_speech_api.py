"""Speech output through the HTTP API in process, on a tiny random Qwen3-Omni: POST /v1/audio/speech
with the openai SDK (every response format; streamed bytes and SSE deltas equal to the whole answer,
which equals LLM.speech's greedy audio), GET /v1/voices, and the refusals, each a 400 naming the field
and leaving no seat held."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import subprocess
import wave

import httpx
import numpy as np
import pytest

from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

openai = pytest.importorskip("openai")
pytest.importorskip("av")

GREEDY = {"talker_temperature": 0, "max_audio_length": 0.8}
TEXT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.tiny_omni import make_tiny_qwen3_omni_speech

    return make_tiny_qwen3_omni_speech(tmp_path_factory.mktemp("omni-speech"))


def _load(tmp_path_factory, checkpoint, **kw):
    from trtedge import LLM

    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    return LLM(str(checkpoint), cache_dir=str(cache), max_kv_cache_capacity=256, max_input_len=64, **kw)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, checkpoint):
    with _load(tmp_path_factory, checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ServeConfig())


@pytest.fixture(scope="module")
def expected(llm):
    from trtedge.runtime.speech.encode import pcm16

    return pcm16(llm.speech(TEXT, voice="chelsie", **GREEDY).audio)


def run(app, fn):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", http_client=http)
            return await fn(client, http)

    return asyncio.run(main())


def create(app, **kw):
    async def fn(client, http):
        reply = await client.audio.speech.create(
            model=kw.pop("model", "ignored-is-refused"),
            input=kw.pop("input", TEXT),
            voice=kw.pop("voice", "chelsie"),
            **kw,
        )
        return reply.content

    return run(app, fn)


def post(app, body: dict) -> httpx.Response:
    return run(app, lambda client, http: http.post("/v1/audio/speech", json=body))


def test_the_sdk_gets_pcm_by_default_equal_to_llm_speech(app, llm, expected):
    body = create(app, model=llm.model_name, extra_body=GREEDY)
    assert len(body) == len(expected) > 0 and body == expected
    assert app.state.admission.num_active == 0


def test_streamed_bytes_and_sse_deltas_concatenate_to_the_whole(app, llm):
    from trtedge.runtime.speech.encode import pcm16

    pieces = list(llm.speech_stream(TEXT, voice="chelsie", codec_chunk_frames=3, **GREEDY))
    assert len(pieces) >= 3  # 3-frame chunks of up to 10 frames
    expected = b"".join(pcm16(p) for p in pieces)

    async def fn(client, http):
        async with client.audio.speech.with_streaming_response.create(
            model=llm.model_name,
            input=TEXT,
            voice="chelsie",
            response_format="pcm",
            extra_body={**GREEDY, "codec_chunk_frames": 3},
        ) as reply:
            assert reply.headers["content-type"] == "audio/pcm"
            return [chunk async for chunk in reply.iter_bytes()]

    chunks = run(app, fn)
    assert b"".join(chunks) == expected
    sse = post(
        app, {"input": TEXT, "voice": "chelsie", "stream_format": "sse", "codec_chunk_frames": 3, **GREEDY}
    )
    events = [json.loads(line[6:]) for line in sse.text.split("\n") if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert len(events) >= 3 and events[-1]["usage"]["input_tokens"] > 0
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == expected
    assert app.state.admission.num_active == 0


def test_wav_reads_back_with_the_rate_and_length(app, llm, expected, tmp_path):
    body = create(app, model=llm.model_name, response_format="wav", extra_body=GREEDY)
    with wave.open(io.BytesIO(body)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == len(expected) // 2
        assert w.readframes(w.getnframes()) == expected
    if shutil.which("sox"):
        path = tmp_path / "a.wav"
        path.write_bytes(body)
        info = subprocess.run(["sox", "--i", str(path)], capture_output=True, text=True, check=True).stdout
        assert "24000" in info and f"{len(expected) // 2} samples" in info


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_encoded_formats_decode_to_about_the_same_length(app, llm, expected, fmt):
    import av

    body = create(app, model=llm.model_name, response_format=fmt, extra_body=GREEDY)
    with av.open(io.BytesIO(body)) as f:
        stream = f.streams.audio[0]
        frames = list(f.decode(stream))
    samples = sum(fr.samples for fr in frames) * 24000 / frames[0].sample_rate
    assert abs(samples - len(expected) / 2) <= 2400  # encoder delay and padding: < 0.1 s
    if fmt == "flac":  # lossless, from the float samples (the encoder's conversion rounds its own way)
        got = np.concatenate([fr.to_ndarray().reshape(-1) for fr in frames]).astype(np.int32)
        want = np.frombuffer(expected, "<i2").astype(np.int32)
        assert got.shape == want.shape and np.abs(got - want).max() <= 1


def test_health_says_speech_output(app):
    reply = run(app, lambda client, http: http.get("/health"))
    assert reply.json()["capabilities"]["speech_output"] is True


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_the_length_not_the_rate(app, llm, expected, speed):
    body = post(app, {"input": TEXT, "voice": "chelsie", "speed": speed, **GREEDY}).content
    samples = len(body) // 2
    assert abs(samples - len(expected) / 2 / speed) < 0.05 * len(expected) / 2 / speed
    assert app.state.admission.num_active == 0


def test_voices_lists_the_speakers(app):
    reply = run(app, lambda client, http: http.get("/v1/voices"))
    assert reply.status_code == 200
    data = reply.json()["data"]
    assert [v["id"] for v in data] == ["aiden", "chelsie", "ethan"]
    assert [v["id"] for v in data if v["default"]] == ["ethan"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"voice": "alloy"}, "voice"),
        ({"input": "w1 " * 80}, "input"),
        ({"input": "x" * 4097}, "input"),
        ({"input": "  "}, "input"),
        ({"speed": 9.0}, "speed"),
        ({"response_format": "ogg"}, "response_format"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"talker_top_p": 0}, "talker_top_p"),
        ({"talker_top_k": -1}, "talker_top_k"),
        ({"talker_top_k": 2.5}, "talker_top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"codec_chunk_frames": 0}, "codec_chunk_frames"),
        ({"max_audio_length": 10000}, "max_audio_length"),
        ({"talker_prefill_threshold": 0}, "talker_prefill_threshold"),
        ({"model": "other"}, "model"),
    ],
)
def test_refusals_name_the_field_and_hold_no_seat(app, body, param):
    reply = post(app, {"input": TEXT, "voice": "ethan", **body})
    assert reply.status_code == (404 if param == "model" else 400), reply.text
    assert reply.json()["error"]["param"] == param
    assert app.state.admission.num_active == 0


def test_a_model_without_a_talker_is_refused_naming_it(tmp_path_factory, checkpoint):
    with _load(tmp_path_factory, checkpoint, components="llm") as text:
        app = build_app(text, ServeConfig())
        reply = post(app, {"input": TEXT, "voice": "ethan"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "model" and "no speech output" in error["message"]
        assert run(app, lambda client, http: http.get("/v1/voices")).json()["data"] == []
        assert app.state.admission.num_active == 0


# ---- chat completions with modalities ["text", "audio"] ---------------------------------------------
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]
CHAT = dict(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def chat_expected(llm):
    """The engine's greedy answer to MESSAGES and the Talker's greedy PCM of it (3-frame chunks)."""
    from trtedge import SamplingParams
    from trtedge.runtime.speech.api import answer_ids
    from trtedge.runtime.speech.encode import pcm16

    ids = llm.encode_prompt(MESSAGES)
    out = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0))
    spoken = answer_ids(ids, out.token_ids, set(llm.tokenizer_info().eos_token_ids))
    pieces = llm.speech_stream(token_ids=spoken, voice="chelsie", codec_chunk_frames=3, **GREEDY)
    return out.text, b"".join(pcm16(p) for p in pieces), out.finish_reason


AUDIO = {"voice": "chelsie", "format": "pcm16"}
EXTRA = {"codec_chunk_frames": 3, **GREEDY}


def test_chat_answers_with_audio_and_its_transcript(app, llm, chat_expected):
    text, pcm, _ = chat_expected

    async def fn(client, http):
        return await client.chat.completions.create(
            model=llm.model_name,
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio=AUDIO,
            extra_body=EXTRA,
            **CHAT,
        )

    reply = run(app, fn)
    message = reply.choices[0].message
    assert message.content is None and message.audio.transcript == text
    assert base64.b64decode(message.audio.data) == pcm and len(pcm) > 0
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > 0
    assert app.state.admission.num_active == 0
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus"])
def test_chat_audio_in_each_format_decodes_to_the_answer_speech(app, llm, chat_expected, fmt):
    import av

    text, pcm, _ = chat_expected

    async def fn(client, http):
        return await client.chat.completions.create(
            model=llm.model_name,
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio={"voice": "chelsie", "format": fmt},
            extra_body=EXTRA,
            **CHAT,
        )

    message = run(app, fn).choices[0].message
    data = base64.b64decode(message.audio.data)
    assert message.audio.transcript == text
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            assert w.readframes(w.getnframes()) == pcm
    else:
        with av.open(io.BytesIO(data)) as f:
            frames = list(f.decode(f.streams.audio[0]))
        samples = sum(fr.samples for fr in frames) * 24000 / frames[0].sample_rate
        assert abs(samples - len(pcm) / 2) <= 2400  # encoder delay and padding: < 0.1 s
    assert app.state.admission.num_active == 0


def test_streamed_chat_sends_transcript_and_audio_deltas(app, llm, chat_expected):
    """The Talker speaks while the text streams (audio deltas may come between transcript deltas); the
    audio is the speech of the whole text."""
    text, pcm, finish = chat_expected

    async def fn(client, http):
        stream = await client.chat.completions.create(
            model=llm.model_name,
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio=AUDIO,
            stream=True,
            extra_body=EXTRA,
            **CHAT,
        )
        return [chunk.model_dump() async for chunk in stream]

    chunks = run(app, fn)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    audio = [d["audio"] for d in deltas if d.get("audio")]
    transcript = "".join(a.get("transcript") or "" for a in audio)
    data = b"".join(base64.b64decode(a["data"]) for a in audio if a.get("data"))
    assert transcript == text and data == pcm
    assert len([a for a in audio if a.get("data")]) >= 2
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == finish
    assert app.state.admission.num_active == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"modalities": ["text", "audio"]}, "audio"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio.voice"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "ogg"}}, "audio.format"),
        (
            {"modalities": ["text", "audio"], "audio": {"format": "wav", "repetition_penalty": 5}},
            "audio.repetition_penalty",
        ),
        ({"modalities": ["text", "audio"], "audio": {"format": "wav"}, "talker_top_p": 0}, "talker_top_p"),
        (
            {"modalities": ["text", "audio"], "audio": {"format": "wav"}, "codec_chunk_frames": 0},
            "codec_chunk_frames",
        ),
        (
            {"modalities": ["text", "audio"], "audio": {"format": "wav"}, "max_audio_length": -1},
            "max_audio_length",
        ),
        ({"modalities": ["text", "audio"], "audio": {"format": "wav"}, "n": 2}, "n"),
        ({"modalities": ["video"]}, "modalities.0"),
        ({"audio": {"format": "wav"}}, "modalities"),
    ],
)
def test_chat_audio_refusals_name_the_field_and_hold_no_seat(app, llm, body, param):
    reply = run(
        app,
        lambda client, http: http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body}
        ),
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert app.state.admission.num_active == 0
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chat_audio_is_refused_with_audio_input_and_without_a_talker(app, tmp_path_factory, checkpoint):
    from tests.tiny_asr import encode_clip, tone

    clip = base64.b64encode(encode_clip(tone(0.5), "wav")).decode()
    part = {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "w5"}]}],
        "modalities": ["text", "audio"],
        "audio": {"format": "wav"},
        "max_tokens": 2,
    }
    reply = run(app, lambda client, http: http.post("/v1/chat/completions", json=body))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "modalities"
    assert app.state.admission.num_active == 0
    with _load(tmp_path_factory, checkpoint, components="llm") as text:
        bare = build_app(text, ServeConfig())
        reply = run(
            bare, lambda client, http: http.post("/v1/chat/completions", json={**body, "messages": MESSAGES})
        )
        assert reply.status_code == 400
        assert (
            reply.json()["error"]["param"] == "modalities"
            and "no speech output" in reply.json()["error"]["message"]
        )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/speech"])
def test_a_client_that_hangs_up_mid_speech_frees_its_seat(app, llm, path):
    from tests.server.asgi import call, wait_for

    long = {"talker_temperature": 0.9, "seed": 3, "max_audio_length": 60, "codec_chunk_frames": 1}
    if path == "/v1/audio/speech":
        body = {"input": TEXT, **long}
        heard = lambda reply: len(reply.chunks) >= 2  # noqa: E731
    else:
        body = {"messages": MESSAGES, "max_tokens": 6, "stream": True, "modalities": ["text", "audio"]}
        body.update(audio={"format": "pcm16"}, **long)
        heard = lambda reply: any(b'"data"' in c for c in reply.chunks)  # noqa: E731

    async def main():
        hang_up = asyncio.Event()
        reply = await call(app, path, body, hang_up=hang_up, on_chunk=lambda r: heard(r) and hang_up.set())
        await wait_for(lambda: app.state.admission.num_active == 0)
        return reply

    reply = asyncio.run(main())
    assert reply.status == 200 and heard(reply)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["active_requests"] == 0
    assert llm.engine.speech.num_states == 0  # the Talker's sequence ended with the client
