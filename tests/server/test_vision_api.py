"""Image and video requests through the HTTP API (OpenAI chat, Anthropic messages, Responses) in process,
on a tiny random Qwen2.5-VL: what reaches ``LLM.encode_prompt`` (recorded by ``Spy``), the sources, the
limits and their statuses, and that no refusal leaks a seat or a KV block. A text-only bundle of the same
checkpoint (``--components llm``) answers 400."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import pytest
import torch

from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

Image = pytest.importorskip("PIL.Image")
tiny_vl = pytest.importorskip("tests.tiny_vl")

CHAT = "/v1/chat/completions"


class Spy:
    """The LLM, recording the media parts each ``encode_prompt`` call is given."""

    def __init__(self, llm):
        self._llm = llm
        self.seen: list[list[dict]] = []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def encode_prompt(self, messages, **options):
        content = [m["content"] for m in messages if isinstance(m["content"], list)]
        self.seen.append([p for parts in content for p in parts if p["type"] != "text"])
        return self._llm.encode_prompt(messages, **options)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_vl.make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl"))


def _load(tmp_path_factory, checkpoint, **kwargs):
    from trtedge import LLM

    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    return LLM(str(checkpoint), cache_dir=str(cache), max_kv_cache_capacity=512, max_input_len=400, **kwargs)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, checkpoint):
    with _load(tmp_path_factory, checkpoint) as llm:
        yield llm


@pytest.fixture
def stub(llm):
    return Spy(llm)


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
    """No seat held, every KV block free (context reuse is off: nothing stays cached)."""
    stats = llm.stats()
    assert app.state.admission.num_active == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["active_requests"] == 0


def test_chat_image_reaches_the_model_as_a_picture(stub, llm):
    app = build_app(stub)
    r = post(app, CHAT, ask(image_part(data_url(png(56, 28)))))
    assert r.status_code == 200, r.text
    [[part]] = stub.seen
    assert part["type"] == "image" and part["image"].mode == "RGB"
    assert part["image"].size == llm.vision.image_size(56, 28)  # held at the size the processor takes
    plain = post(app, CHAT, ask())
    grown = r.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert grown == llm.vision.image_tokens(56, 28) + 2  # the placeholders between vision start and end
    # a bare string image_url and "detail": "low" (fits 512 x 512 first: 800 x 16 -> 512 x 10)
    post(app, CHAT, ask({"type": "image_url", "image_url": data_url(png(800, 16))}))
    post(app, CHAT, ask(image_part(data_url(png(800, 16)), detail="low")))
    sizes = [llm.vision.image_size(800, 16), llm.vision.image_size(512, 10)]
    assert [s[0]["image"].size for s in stub.seen[1:]] == sizes == [(448, 8), (512, 8)]
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
    assert stub.seen[0][0]["image"].size == llm.vision.image_size(56, 28)
    counted = post(app, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]
    streamed = post(app, "/v1/messages", {**body, "stream": True})
    start = json.loads(next(line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")))
    assert start["type"] == "message_start"
    assert start["message"]["usage"]["input_tokens"] == r.json()["usage"]["input_tokens"]
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
    assert stub.seen[0][0]["image"].size == llm.vision.image_size(56, 28)
    content[1] = {"type": "input_image", "file_id": "file-123"}
    r = post(app, "/v1/responses", {"input": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.1.file_id"
    assert_clean(app, llm)


def mp4(num_frames: int, rate: int, side: int) -> bytes:
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_image(Image.new("RGB", (side, side), (i * 10, 0, 0)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_video_frames_follow_fps_and_nframes(stub, llm):
    url = data_url(mp4(16, 8, 56), "video/mp4")  # two seconds
    app = build_app(stub, ServeConfig(max_video_frames=3))
    r = post(app, CHAT, ask({"type": "video_url", "video_url": {"url": url, "fps": 2}}))
    assert r.status_code == 200, r.text
    assert r.status_code == 200 and len(stub.seen[0][0]["video"]) == 3  # --max-video-frames caps 4
    assert stub.seen[0][0]["fps"] == pytest.approx(1.5)
    r = post(app, CHAT, ask({"type": "video_url", "video_url": {"url": url, "fps": 1, "nframes": 1}}))
    assert r.status_code == 200 and len(stub.seen[1][0]["video"]) == 1
    # large frames are held at the size the processor takes them (256 x 256 -> 64 x 64)
    big = data_url(mp4(8, 8, 256), "video/mp4")
    r = post(app, CHAT, ask({"type": "video_url", "video_url": {"url": big, "fps": 2}}))
    frames = stub.seen[2][0]["video"]
    assert r.status_code == 200 and [f.size for f in frames] == [(64, 64)] * 2
    assert_clean(app, llm)


@pytest.mark.parametrize(
    "config,parts,status,param,text",
    [
        (  # 32 x 32 pixels are 16 image tokens, 64 x 64 are 64 (8 x 8 pixels each)
            {"max_image_tokens_per_image": 20},
            [image_part(data_url(png(32, 32))), image_part(data_url(png(64, 64)))],
            400,
            "messages.0.content.2.image_url",
            "--max-image-tokens-per-image 20",
        ),
        (
            {"max_image_tokens": 70},
            [image_part(data_url(png(32, 32))), image_part(data_url(png(64, 64)))],
            400,
            "messages.0.content.2.image_url",
            "--max-image-tokens 70",
        ),
        ({"max_media_bytes": 1000}, [image_part(data_url(b"x" * 2000))], 413, None, "--max-media-bytes"),
        ({}, [image_part(data_url(b"not an image"))], 400, None, "cannot read the image"),
        ({}, [image_part(data_url(png(1, 300)))], 400, None, "aspect ratio"),
        ({}, [image_part("https://example.com/cat.png")], 403, None, "--allow-remote-media"),
        ({}, [image_part("file:///etc/passwd")], 403, None, "--allowed-local-media-path"),
        ({}, [image_part("cat.png")], 403, None, "--allowed-local-media-path"),
    ],
    ids=[
        "per-image",
        "per-request",
        "oversize",
        "undecodable",
        "aspect-ratio",
        "remote",
        "local-off",
        "relative-off",
    ],
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


@pytest.fixture(scope="module")
def text_only(tmp_path_factory, checkpoint):
    with _load(tmp_path_factory, checkpoint, components="llm") as llm:
        yield llm


def test_misplaced_media_and_a_text_only_model(stub, llm, text_only, monkeypatch):
    app = build_app(stub)
    image = image_part(data_url(png()))
    body = {"messages": [{"role": "assistant", "content": [image]}, {"role": "user", "content": "hi"}]}
    r = post(app, CHAT, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.image_url"
    r = post(app, CHAT, {**ask(image), "apply_chat_template": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "apply_chat_template"
    r = post(build_app(text_only), CHAT, ask(image))
    assert r.status_code == 400 and "this model has no vision component" in r.json()["error"]["message"]
    claude = {"model": text_only.model_name, "max_tokens": 4}
    source = {"type": "base64", "media_type": "image/png", "data": b64(png())}
    claude["messages"] = [{"role": "user", "content": [{"type": "image", "source": source}]}]
    r = post(build_app(text_only), "/v1/messages", claude)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    message = r.json()["error"]["message"]
    assert message.startswith("messages.0.content.0.source: this model has no vision component"), message
    monkeypatch.setitem(__import__("sys").modules, "PIL", None)
    r = post(app, CHAT, ask(image))
    assert r.status_code == 501 and "pip install 'trtedge[vision]'" in r.json()["error"]["message"]
    assert stub.seen == []
    assert_clean(app, llm)


def test_health_reports_vision(stub, text_only):
    async def main(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/health")).json()

    assert asyncio.run(main(build_app(stub)))["capabilities"]["vision"] is True
    assert asyncio.run(main(build_app(text_only)))["capabilities"]["vision"] is False


def test_decoded_images_are_held_at_the_size_the_model_takes_them(stub, llm):
    """A small file may decode to a large canvas: the server keeps it resized to the processor's size
    (same pixels the processor would make), and stops once the pictures pass max_input_len."""
    app = build_app(stub, ServeConfig())
    r = post(app, CHAT, ask(image_part(data_url(png(640, 640)))))
    assert r.status_code == 200, r.text
    assert stub.seen[0][0]["image"].size == llm.vision.image_size(640, 640) == (64, 64)
    stub.seen.clear()
    many = [image_part(data_url(png(640, 640))) for _ in range(7)]  # 7 x 64 tokens > max_input_len 400
    r = post(app, CHAT, ask(*many))
    error = r.json()["error"]
    assert r.status_code == 400 and "max_input_len 400" in error["message"], error
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages.0.content.7.image_url"
    assert stub.seen == []
    assert_clean(app, llm)


def test_a_fitted_image_gives_the_same_patches_as_the_original():
    from trtedge.runtime.multimodal.processor import VisionProcessor
    from trtedge.server.multimodal import MediaRef, _decode_fitted

    vision = VisionProcessor(patch_size=4, min_pixels=256, max_pixels=4096)
    out = io.BytesIO()
    original = tiny_vl.random_image(300, 170, 5)
    original.save(out, "PNG")
    fitted, tokens = _decode_fitted(out.getvalue(), MediaRef((0, 0), "image", "", "p"), vision)
    assert fitted.size != original.size and tokens == vision.image_tokens(300, 170)
    assert torch.equal(vision.image(fitted).pixels, vision.image(original).pixels)
