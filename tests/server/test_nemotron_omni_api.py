"""Nemotron Omni video through the chat API, in process: a video_url (an MP4 encoded with PyAV in the
test) answers as the engine does for the same frames; one video and no image per request, fps or
nframes (not both) and the tubelet capacity are checked before anything is fetched or decoded (400s
naming the field), and nothing stays held."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest

from trtedge.runtime.sampling_params import SamplingParams
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")
tiny = pytest.importorskip("tests.tiny_nemotron_omni")

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from trtedge import LLM

    checkpoint = tiny.make_tiny_nemotron_omni(tmp_path_factory.mktemp("nemotron-omni"))
    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    with LLM(str(checkpoint), cache_dir=str(cache), max_kv_cache_capacity=512, max_input_len=400) as llm:
        yield llm


def mp4(num_frames: int = 8, rate: int = 4) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        for frame in tiny.frames(num_frames, 32, 48):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def post(app, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(CHAT, json=body)

    return asyncio.run(main())


def ask(*parts: dict, max_tokens: int = 6) -> dict:
    content = [*parts, {"type": "text", "text": "w5 w6"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}


def video(data_url: str, **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url, **extra}}


def assert_clean(app, llm) -> None:
    stats = llm.stats()
    assert app.state.admission.num_active == 0 and stats["active_requests"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["state_slots_free"] == stats["state_slots_total"]


def test_a_video_answers_as_the_engine_does_for_its_frames(llm):
    from trtedge.server.decoding import decode_video

    app = build_app(llm)
    clip = mp4()
    r = post(app, ask(video(url(clip), fps=2)))
    assert r.status_code == 200, r.text
    frames, fps = decode_video(clip, "video", 2.0, 32, None)
    messages = [
        {
            "role": "user",
            "content": [{"type": "video", "video": frames, "fps": fps}, {"type": "text", "text": "w5 w6"}],
        }
    ]
    want = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0))
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["prompt_tokens"] == want.prompt_tokens
    r = post(app, ask(video(url(clip), nframes=3)))  # three frames over the whole clip: two tubelets
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < want.prompt_tokens
    assert_clean(app, llm)


@pytest.mark.parametrize(
    ("parts", "param"),
    [
        ([video("data:video/mp4;base64,AAAA", fps=2, nframes=4)], "messages.0.content.0.video_url.nframes"),
        (
            [video("data:video/mp4;base64,AAAA"), video("data:video/mp4;base64,AAAA")],
            "messages.0.content.1.video_url",
        ),
        (
            [
                video("data:video/mp4;base64,AAAA"),
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
            "messages.0.content.1.image_url",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
            "messages.0.content.0.image_url",
        ),
        ([video("data:video/mp4;base64,AAAA", nframes=1000)], "messages.0.content.0.video_url.nframes"),
    ],
)
def test_refusals_come_before_decoding_and_name_the_field(llm, parts, param):
    app = build_app(llm, ServeConfig(max_video_frames=1000))
    r = post(app, ask(*parts))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert_clean(app, llm)


def test_a_video_over_the_tubelet_capacity_stops_at_its_first_frame(llm, monkeypatch):
    import trtedge.server.multimodal as mm

    seen = []
    check = mm._omni_frames
    monkeypatch.setattr(mm, "_omni_frames", lambda *a: seen.append(a[2]) or check(*a))
    app = build_app(llm, ServeConfig(max_video_frames=1000))
    r = post(app, ask(video(url(mp4(300, 30)), fps=30)))  # 300 frames: 150 tubelets, the cap is 128
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.video_url"
    assert "150 tubelets" in r.json()["error"]["message"] and seen == [300]
    assert_clean(app, llm)
