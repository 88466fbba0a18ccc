"""Media sources and decoding: data URLs, local files confined to --allowed-local-media-path, remote URLs
(refused unless --allow-remote-media; then capped in size and time, against a local HTTP server), and
Pillow / PyAV decoding with its limits, each refusal with its documented status."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trtedge.server.config import ServeConfig
from trtedge.server.errors import APIError
from trtedge.server.media import fetch_media

PIL = pytest.importorskip("PIL")
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from trtedge.server import decoding  # noqa: E402

PARAM = "messages.0.content.1.image_url"


def png(width: int = 40, height: int = 20, mode: str = "RGB", color=(200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def fetch(url: str, **config) -> bytes:
    return asyncio.run(fetch_media(url, ServeConfig(**config), PARAM))


def refused(url: str, status: int, code: str, **config) -> APIError:
    with pytest.raises(APIError) as e:
        fetch(url, **config)
    assert (e.value.status, e.value.code, e.value.param) == (status, code, PARAM), e.value.message
    return e.value


# ---- data URLs ----------------------------------------------------------------------------------
def test_data_urls_decode_and_are_capped():
    image = png()
    assert fetch(data_url(image)) == image
    assert fetch("data:text/plain,hello%20world") == b"hello world"
    refused("data:image/png;base64,!!not base64!!", 400, "invalid_media_url")
    refused("data:image/png;base64", 400, "invalid_media_url")
    error = refused(data_url(b"x" * 5000), 413, "media_too_large", max_media_bytes=4096)
    assert "--max-media-bytes 4096" in error.message
    refused("ftp://example.com/cat.png", 400, "invalid_media_url")


# ---- local files --------------------------------------------------------------------------------
@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(png())
    (root / "big.png").write_bytes(b"x" * 5000)
    secret = tmp_path / "secret.png"
    secret.write_bytes(png())
    os.symlink(secret, root / "escape.png")
    return root


def test_local_files_inside_the_allowed_directory_are_read(media_dir):
    allowed = {"allowed_local_media_path": str(media_dir)}
    assert fetch(f"file://{media_dir}/cat.png", **allowed) == (media_dir / "cat.png").read_bytes()
    assert fetch("cat.png", **allowed) == (media_dir / "cat.png").read_bytes()
    refused("big.png", 413, "media_too_large", max_media_bytes=4096, **allowed)
    refused("missing.png", 404, "not_found", **allowed)


@pytest.mark.parametrize(
    "url",
    ["file://{root}/../secret.png", "{root}/../secret.png", "../secret.png", "escape.png", "/etc/passwd"],
)
def test_traversal_and_symlinks_out_of_the_directory_are_403(media_dir, url):
    error = refused(
        url.format(root=media_dir), 403, "local_media_forbidden", allowed_local_media_path=str(media_dir)
    )
    assert "outside --allowed-local-media-path" in error.message


def test_local_files_are_403_unless_a_directory_is_allowed(media_dir):
    error = refused(f"file://{media_dir}/cat.png", 403, "local_media_forbidden")
    assert "--allowed-local-media-path" in error.message


# ---- remote URLs --------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    sent: dict = {}

    def do_GET(self):  # noqa: N802
        image = png()
        if self.path == "/cat.png":
            self._reply(200, image)
        elif self.path == "/announced-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        elif self.path == "/endless":  # no Content-Length: the cap must stop the download itself
            self.send_response(200)
            self.end_headers()
            sent = 0
            try:
                while sent < 50 * 2**20:
                    self.wfile.write(b"x" * 65536)
                    sent += 65536
            except OSError:
                pass
            _Handler.sent["endless"] = sent
        elif self.path == "/slow":
            time.sleep(2)
            self._reply(200, image)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        else:
            self._reply(404, b"no")

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client gave up (timeout tests)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def remote():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_urls_are_403_unless_allowed(remote):
    error = refused(f"{remote}/cat.png", 403, "remote_media_forbidden")
    assert "--allow-remote-media" in error.message


def test_remote_urls_are_fetched_when_allowed(remote):
    assert fetch(f"{remote}/cat.png", allow_remote_media=True) == png()
    assert fetch(f"{remote}/moved", allow_remote_media=True) == png()
    error = refused(f"{remote}/missing.png", 400, "media_fetch_failed", allow_remote_media=True)
    assert "HTTP 404" in error.message


def test_oversize_remote_bodies_are_413_without_reading_them_whole(remote):
    allowed = {"allow_remote_media": True, "max_media_bytes": 2**20}
    refused(f"{remote}/announced-huge", 413, "media_too_large", **allowed)
    refused(f"{remote}/endless", 413, "media_too_large", **allowed)
    deadline = time.monotonic() + 10
    while "endless" not in _Handler.sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _Handler.sent["endless"] < 50 * 2**20  # the client hung up long before the server was done


def test_slow_remote_urls_time_out(remote):
    error = refused(
        f"{remote}/slow", 400, "media_fetch_timeout", allow_remote_media=True, media_fetch_timeout=0.5
    )
    assert "--media-fetch-timeout" in error.message


def test_a_fetch_does_not_block_the_event_loop(remote):
    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        config = ServeConfig(allow_remote_media=True, media_fetch_timeout=1.0)
        with pytest.raises(APIError):
            await fetch_media(f"{remote}/slow", config, PARAM)
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) >= 5


# ---- decoding -----------------------------------------------------------------------------------
def test_images_decode_to_rgb_with_transparency_on_white():
    image = decoding.decode_image(png(40, 20), PARAM)
    assert image.mode == "RGB" and image.size == (40, 20) and image.getpixel((0, 0)) == (200, 10, 10)
    clear = decoding.decode_image(png(8, 8, "RGBA", (0, 0, 0, 0)), PARAM)
    assert clear.mode == "RGB" and clear.getpixel((3, 3)) == (255, 255, 255)
    gray = decoding.decode_image(png(8, 8, "L", 7), PARAM)
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (7, 7, 7)
    deep = io.BytesIO()  # a 16-bit grayscale PNG keeps its levels (not clipped to white)
    Image.fromarray(np.full((4, 6), 30000, dtype=np.uint16)).save(deep, "PNG")
    deep_gray = decoding.decode_image(deep.getvalue(), PARAM)
    assert deep_gray.mode == "RGB" and deep_gray.getpixel((0, 0)) == (117, 117, 117)
    low = decoding.decode_image(png(2048, 1024), PARAM, detail="low")
    assert low.size == (512, 256)


def test_exif_orientation_is_applied():
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the stored 40x20 picture is shown 20x40
    Image.new("RGB", (40, 20), (0, 90, 0)).save(out, "JPEG", exif=exif.tobytes())
    assert decoding.decode_image(out.getvalue(), PARAM).size == (20, 40)


@pytest.mark.parametrize(
    "data",
    [b"this is not an image", png()[:60], b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"],
    ids=["text", "truncated", "eps"],
)
def test_undecodable_images_are_400(data):
    with pytest.raises(APIError) as e:
        decoding.decode_image(data, PARAM)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_image", PARAM)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bombs_are_413_before_decoding():
    # A 30 KB PNG whose header claims 10000 x 10000 pixels (100 megapixels).
    out = io.BytesIO()
    Image.new("1", (10000, 10000)).save(out, "PNG")
    started = time.monotonic()
    with pytest.raises(APIError) as e:
        decoding.decode_image(out.getvalue(), PARAM)
    assert (e.value.status, e.value.code) == (413, "image_too_large")
    assert "10000x10000" in e.value.message
    assert time.monotonic() - started < 5


def video(num_frames: int, rate: int, size=(64, 48)) -> bytes:
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_image(Image.new("RGB", size, (i * 8 % 256, 0, 0)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_video_frames_are_sampled_at_fps_and_capped():
    clip = video(30, 10)  # 3 seconds
    frames, fps = decoding.decode_video(clip, PARAM, fps=2.0, max_frames=32)
    assert len(frames) == 6 and fps == pytest.approx(2.0)
    assert frames[0].mode == "RGB" and frames[0].size == (64, 48)
    # red channel rises 8 per source frame: frames sampled every 0.5 s are 5 source frames apart
    reds = [f.getpixel((10, 10))[0] for f in frames]
    assert all(35 <= b - a <= 45 for a, b in zip(reds, reds[1:])), reds
    frames, fps = decoding.decode_video(clip, PARAM, fps=4.0, max_frames=4)
    assert len(frames) == 4 and fps == pytest.approx(4 / 3)


def test_undecodable_video_is_400():
    pytest.importorskip("av")
    with pytest.raises(APIError) as e:
        decoding.decode_video(b"not a video at all" * 10, PARAM, fps=2.0, max_frames=8)
    assert (e.value.status, e.value.code) == (400, "invalid_video")


def test_missing_pillow_is_501_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(APIError) as e:
        decoding.require()
    assert e.value.status == 501 and "pip install 'trtedge[vision]'" in e.value.message
    assert "image input needs Pillow" in e.value.message
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(APIError) as e:
        decoding.require(video=True)
    assert e.value.status == 501 and "video input needs PyAV" in e.value.message


def test_video_frames_over_the_pixel_cap_are_413_before_decoding(monkeypatch):
    clip = video(4, 4)
    monkeypatch.setattr(decoding, "MAX_PIXELS", 64 * 48 - 1)
    with pytest.raises(APIError) as e:
        decoding.decode_video(clip, PARAM, fps=2.0, max_frames=8)
    assert (e.value.status, e.value.code) == (413, "image_too_large") and "64x48" in e.value.message
