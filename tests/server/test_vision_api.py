"""Image and video requests through the HTTP API (OpenAI chat, Anthropic messages, Responses) against the
embedded model dressed as a vision model (``VisionStub``: the images reach ``encode_prompt`` as pictures
and come back as words), so that the server's side is tested apart from the vision runtime: translation,
sources, limits and their statuses, and that no refusal leaks a seat or a KV block."""

from __future__ import annotations

import asyncio
import base64
import io
import math
from dataclasses import dataclass

import httpx
import pytest

from tests.server.conftest import load_llm
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

Image = pytest.importorskip("PIL.Image")

CHAT = "/v1/chat/completions"


@dataclass
class StubPrompt:
    ids: list[int]
    items: list


class StubVision:
    """28x28 pixels per token, two frames per temporal patch (Qwen2.5-VL's arithmetic)."""

    def image_tokens(self, width: int, height: int) -> int:
        return math.ceil(width / 28) * math.ceil(height / 28)

    def video_tokens(self, num_frames: int, width: int, height: int) -> int:
        return math.ceil(num_frames / 2) * self.image_tokens(width, height)


class VisionStub:
    """An LLM whose images are told to the text model as "a picture W by H"."""

    def __init__(self, llm):
        self._llm = llm
        self.vision = StubVision()
        self.seen: list[list[dict]] = []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def encode_prompt(self, messages, **options):
        media, plain = [], []
        for m in messages:
            if isinstance(m["content"], list):
                media += [p for p in m["content"] if p["type"] != "text"]
                m = {**m, "content": " ".join(_words(p) for p in m["content"])}
            plain.append(m)
        self.seen.append(media)
        return StubPrompt(self._llm.encode_prompt(plain, **options), media)

    def generate_stream(self, prompt, params=None, **options):
        return self._llm.generate_stream(getattr(prompt, "ids", prompt), params, **options)


def _words(part: dict) -> str:
    if part["type"] == "text":
        return part["text"]
    if part["type"] == "image":
        return "a picture {} by {}".format(*part["image"].size)
    return f"a video of {len(part['video'])} frames"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = load_llm(tmp_path_factory)
    yield llm
    llm.close()


@pytest.fixture
def stub(llm):
    return VisionStub(llm)


def png(width: int = 56, height: int = 28) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (250, 200, 0)).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


def post(app, path: str, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def ask(*parts: dict, text: str = "What is in the picture?") -> dict:
    content = [{"type": "text", "text": text}, *parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def assert_clean(app, llm) -> None:
    stats = llm.stats()
    assert app.state.admission.num_active == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["active_requests"] == 0


def test_chat_image_reaches_the_model_as_a_picture(stub, llm):
    app = build_app(stub)
    r = post(app, CHAT, ask(image_part(data_url(png(56, 28)))))
    assert r.status_code == 200, r.text
    [[part]] = stub.seen
    assert part["type"] == "image" and part["image"].mode == "RGB" and part["image"].size == (56, 28)
    plain = post(app, CHAT, ask())
    assert r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    # a bare string image_url and "detail": "low" (fits 512 x 512)
    post(app, CHAT, ask({"type": "image_url", "image_url": data_url(png(1024, 256))}))
    post(app, CHAT, ask(image_part(data_url(png(1024, 256)), detail="low")))
    assert [s[0]["image"].size for s in stub.seen[1:]] == [(1024, 256), (512, 128)]
    assert_clean(app, llm)


def test_anthropic_base64_image_and_count_tokens(stub, llm):
    app = build_app(stub)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png())}}
    body = {
        "model": stub.model_name,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}],
    }
    r = post(app, "/v1/messages", body)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    assert stub.seen[0][0]["image"].size == (56, 28)
    counted = post(app, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]
    bad = {**image, "source": {**image["source"], "media_type": "image/tiff"}}
    r = post(app, "/v1/messages", {**body, "messages": [{"role": "user", "content": [bad]}]})
    assert r.status_code == 400 and "messages.0.content.0.source.media_type" in r.json()["error"]["message"]
    remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    r = post(app, "/v1/messages", {**body, "messages": [{"role": "user", "content": [remote]}]})
    error = r.json()["error"]
    assert r.status_code == 403 and error["type"] == "permission_error", r.text
    assert "messages.0.content.0.source" in error["message"] and "--allow-remote-media" in error["message"]
    assert_clean(app, llm)


def test_responses_input_image(stub, llm):
    app = build_app(stub)
    content = [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": data_url(png())},
    ]
    r = post(app, "/v1/responses", {"input": [{"role": "user", "content": content}], "max_output_tokens": 4})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    assert stub.seen[0][0]["image"].size == (56, 28)
    content[1] = {"type": "input_image", "file_id": "file-123"}
    r = post(app, "/v1/responses", {"input": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.1.file_id"
    assert_clean(app, llm)


def test_video_frames_follow_fps_and_nframes(stub, llm):
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for i in range(16):  # two seconds
            frame = av.VideoFrame.from_image(Image.new("RGB", (56, 56), (i * 10, 0, 0)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    url = data_url(out.getvalue(), "video/mp4")
    app = build_app(stub, ServeConfig(max_video_frames=3))
    r = post(app, CHAT, ask({"type": "video_url", "video_url": {"url": url, "fps": 2}}))
    assert r.status_code == 200, r.text
    assert r.status_code == 200 and len(stub.seen[0][0]["video"]) == 3  # --max-video-frames caps 4
    assert stub.seen[0][0]["fps"] == pytest.approx(1.5)
    r = post(app, CHAT, ask({"type": "video_url", "video_url": {"url": url, "fps": 1, "nframes": 1}}))
    assert r.status_code == 200 and len(stub.seen[1][0]["video"]) == 1
    assert_clean(app, llm)


@pytest.mark.parametrize(
    "config,parts,status,param,text",
    [
        (
            {"max_image_tokens_per_image": 4},
            [image_part(data_url(png(56, 28))), image_part(data_url(png(84, 56)))],
            400,
            "messages.0.content.2.image_url",
            "--max-image-tokens-per-image 4",
        ),
        (
            {"max_image_tokens": 6},
            [image_part(data_url(png(56, 28))), image_part(data_url(png(84, 56)))],
            400,
            "messages.0.content.2.image_url",
            "--max-image-tokens 6",
        ),
        ({"max_media_bytes": 1000}, [image_part(data_url(b"x" * 2000))], 413, None, "--max-media-bytes"),
        ({}, [image_part(data_url(b"not an image"))], 400, None, "cannot read the image"),
        ({}, [image_part("https://example.com/cat.png")], 403, None, "--allow-remote-media"),
        ({}, [image_part("file:///etc/passwd")], 403, None, "--allowed-local-media-path"),
        ({}, [image_part("cat.png")], 403, None, "--allowed-local-media-path"),
    ],
    ids=["per-image", "per-request", "oversize", "undecodable", "remote", "local-off", "relative-off"],
)
def test_refusals_have_their_status_and_leak_nothing(stub, llm, config, parts, status, param, text):
    app = build_app(stub, ServeConfig(**config))
    r = post(app, CHAT, ask(*parts))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == (param or "messages.0.content.1.image_url") and text in error["message"], error
    assert stub.seen == []  # refused before the prompt was built, let alone admitted
    assert_clean(app, llm)


def test_local_files_traversal_is_403_through_the_api(stub, llm, tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    app = build_app(stub, ServeConfig(allowed_local_media_path=str(root)))
    assert post(app, CHAT, ask(image_part("cat.png"))).status_code == 200
    assert post(app, CHAT, ask(image_part(f"file://{root}/cat.png"))).status_code == 200
    r = post(app, CHAT, ask(image_part(f"file://{root}/../secret.png")))
    assert r.status_code == 403 and "outside --allowed-local-media-path" in r.json()["error"]["message"]
    assert_clean(app, llm)


def test_misplaced_media_and_a_text_only_model(stub, llm, monkeypatch):
    app = build_app(stub)
    image = image_part(data_url(png()))
    body = {"messages": [{"role": "assistant", "content": [image]}, {"role": "user", "content": "hi"}]}
    r = post(app, CHAT, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.image_url"
    r = post(app, CHAT, {**ask(image), "apply_chat_template": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "apply_chat_template"
    r = post(build_app(llm), CHAT, ask(image))  # the embedded model itself has no vision component
    assert r.status_code == 400 and "this model has no vision component" in r.json()["error"]["message"]
    monkeypatch.setitem(__import__("sys").modules, "PIL", None)
    r = post(app, CHAT, ask(image))
    assert r.status_code == 501 and "pip install 'trtedge[vision]'" in r.json()["error"]["message"]
    assert stub.seen == []
    assert_clean(app, llm)


def test_health_reports_vision(stub, llm):
    async def main(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/health")).json()

    assert asyncio.run(main(build_app(stub)))["capabilities"]["vision"] is True
    assert asyncio.run(main(build_app(llm)))["capabilities"]["vision"] is False
