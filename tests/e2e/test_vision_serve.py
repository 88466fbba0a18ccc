"""`trtedge serve` on a tiny random Qwen2.5-VL checkpoint, driven by the official openai and anthropic
SDKs: images sent as data URLs, base64 blocks and local files get answers; media from outside the media
directory, remote URLs and oversize images are refused with their documented statuses."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("PIL")
tiny_vl = pytest.importorskip("tests.tiny_vl")

MAX_MEDIA_BYTES = 100_000


def png(seed: int = 0, width: int = 40, height: int = 56) -> bytes:
    out = io.BytesIO()
    tiny_vl.random_image(width, height, seed).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png(1))
    (root.parent / "secret.png").write_bytes(png(2))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, media):
    checkpoint = tiny_vl.make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl"))
    args = [
        str(checkpoint), "--max-kv-cache-capacity", "512", "--max-input-len", "384",
        "--allowed-local-media-path", str(media), "--max-media-bytes", str(MAX_MEDIA_BYTES),
        "--max-image-tokens-per-image", "48", "--log-level", "warning",
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


def ask(url: str, text: str = "w1 w2 w3") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def test_health_says_vision(server):
    assert server.health()["capabilities"]["vision"] is True


def test_openai_sdk_sends_an_image(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ask(data_url(png())), max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens == 8 or reply.choices[0].finish_reason == "stop"
    text_only = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=1
    )
    # 40 x 56 pixels are 35 placeholder tokens (8 x 8 pixels each) plus the vision start/end tokens
    assert reply.usage.prompt_tokens - text_only.usage.prompt_tokens == 37
    again = client.chat.completions.create(
        model=model, messages=ask(data_url(png())), max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == reply.choices[0].message.content
    other = client.chat.completions.create(
        model=model, messages=ask(data_url(png(5))), max_tokens=8, temperature=0
    )
    assert other.usage.prompt_tokens == reply.usage.prompt_tokens


def test_openai_sdk_local_file_and_responses(client, model):
    reply = client.chat.completions.create(model=model, messages=ask("cat.png"), max_tokens=4)
    assert reply.choices[0].message.content.strip()
    response = client.responses.create(
        model=model,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "w1 w2"},
                    {"type": "input_image", "image_url": data_url(png())},
                ],
            }
        ],
        max_output_tokens=4,
    )
    assert response.status in ("completed", "incomplete") and response.output_text.strip()


def test_anthropic_sdk_sends_a_base64_image(server, model):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()},
    }
    message = claude.messages.create(
        model=model,
        max_tokens=8,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "w1 w2 w3"}]}],
    )
    assert message.content[0].type == "text" and message.content[0].text.strip()
    counted = claude.messages.count_tokens(
        model=model, messages=[{"role": "user", "content": [image, {"type": "text", "text": "w1 w2 w3"}]}]
    )
    assert counted.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.PermissionDeniedError, match="--allow-remote-media"):
        remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [remote]}])


def test_refusals_reach_the_sdk_with_their_status(server, client, model, media):
    with pytest.raises(openai.PermissionDeniedError, match="outside --allowed-local-media-path"):
        client.chat.completions.create(model=model, messages=ask("../secret.png"), max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError, match="outside --allowed-local-media-path"):
        client.chat.completions.create(
            model=model, messages=ask(f"file://{media}/../secret.png"), max_tokens=4
        )
    with pytest.raises(openai.PermissionDeniedError, match="--allow-remote-media"):
        client.chat.completions.create(model=model, messages=ask("http://127.0.0.1:9/cat.png"), max_tokens=4)
    big = png(3, 200, 200)
    assert len(big) > MAX_MEDIA_BYTES
    with pytest.raises(openai.APIStatusError, match="--max-media-bytes") as e:
        client.chat.completions.create(model=model, messages=ask(data_url(big)), max_tokens=4)
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="--max-image-tokens-per-image 48"):
        client.chat.completions.create(model=model, messages=ask(data_url(png(4, 96, 96))), max_tokens=4)
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["active_requests"] == 0
    assert health["engine"]["kv_blocks_free"] == health["engine"]["kv_blocks_total"]
