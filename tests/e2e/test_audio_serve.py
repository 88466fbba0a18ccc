"""`trtedge serve` on a tiny random Qwen3-ASR checkpoint, driven by the official openai SDK:
``audio.transcriptions.create`` (json and text, streamed and not) answers with the transcript the
same server gives for the same clip; refused uploads get their documented statuses and hold nothing;
an audio part in chat is heard."""

from __future__ import annotations

import base64

import pytest

from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("av")
tiny_asr = pytest.importorskip("tests.tiny_asr")

MAX_AUDIO_BYTES = 200_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = tiny_asr.make_tiny_qwen3_asr(tmp_path_factory.mktemp("tiny-asr"))
    args = [
        str(checkpoint), "--max-kv-cache-capacity", "256", "--max-input-len", "200",
        "--max-audio-bytes", str(MAX_AUDIO_BYTES), "--max-audio-seconds", "3",
        "--override-generation-config", '{"max_new_tokens": 12}', "--log-level", "warning",
    ]  # fmt: skip
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def clip() -> bytes:
    return tiny_asr.encode_clip(tiny_asr.tone(1.4, seed=2), "mp3")


def held(server) -> tuple[int, int]:
    engine = server.health()["engine"]
    return engine["running"] + engine["waiting"], engine["kv_blocks_total"] - engine["kv_blocks_free"]


def test_health_says_audio(server):
    assert server.health()["capabilities"]["audio"] is True


def test_sdk_transcribes_json_text_and_streamed(client, model, clip, server):
    first = client.audio.transcriptions.create(model=model, file=("clip.mp3", clip), language="en")
    again = client.audio.transcriptions.create(model=model, file=("clip.mp3", clip), language="en")
    assert first.text and first.text == again.text  # greedy: the same clip, the same words
    assert first.usage.output_tokens == 12 and first.usage.input_token_details.audio_tokens > 0
    text = client.audio.transcriptions.create(
        model=model, file=("clip.mp3", clip), language="en", response_format="text"
    )
    assert text.strip() == first.text
    events = list(
        client.audio.transcriptions.create(model=model, file=("clip.mp3", clip), language="en", stream=True)
    )
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and events[-1] is done[0] and done[0].text == first.text
    assert "".join(deltas).strip() == first.text
    assert held(server) == (0, 0)


def test_sdk_refusals(client, model, clip, server):
    cases = [
        (("big.wav", b"RIFF" + bytes(MAX_AUDIO_BYTES + 10)), {}, 413, "audio_too_large"),
        (("long.wav", tiny_asr.encode_clip(tiny_asr.tone(4.0), "wav")), {}, 400, "audio_too_long"),
        (("bad.mp3", b"ID3" + bytes(500)), {}, 400, "invalid_audio"),
        (("x.txt", b"hello, this is text"), {}, 400, "invalid_audio"),
        (("clip.mp3", clip), {"response_format": "srt"}, 400, "unsupported_value"),
        (("../../../etc/passwd", clip), {"language": "xx"}, 400, "invalid_value"),
    ]
    for file, extra, status, code in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.audio.transcriptions.create(model=model, file=file, **extra)
        assert (e.value.status_code, e.value.body["code"]) == (status, code), e.value.body
    assert held(server) == (0, 0)


def test_chat_hears_an_input_audio_part(client, model, clip):
    content = [
        {"type": "text", "text": "w1 w2"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "mp3"}},
    ]
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
    )
    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=4, temperature=0
    )
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 10
