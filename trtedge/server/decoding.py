"""Media bytes -> RGB pictures: images with Pillow, video frames with PyAV (the optional ``vision`` extra).

Both refuse more than ``MAX_PIXELS`` per picture (413) before decoding the pixels, so a small file that
claims a huge canvas (a decompression bomb) costs nothing; bytes they cannot read are a 400.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

from trtedge.server.errors import APIError

MAX_PIXELS = 50_000_000  # per image or video frame
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # no plugin that shells out (EPS) or is rarely sound
LOW_DETAIL_SIDE = 512  # "detail": "low" fits the image in a square of this side
INSTALL = "pip install 'trtedge[vision]'"
_PACKAGES = {"PIL": "Pillow", "av": "PyAV"}


def require(video: bool = False) -> None:
    """501 naming the extra to install when Pillow (or PyAV for video) is missing."""
    try:
        import PIL.Image  # noqa: F401

        if video:
            import av  # noqa: F401
    except ImportError as e:
        kind, package = "video" if video else "image", _PACKAGES.get(e.name, "Pillow")
        raise APIError(
            501,
            f"{kind} input needs {package}, which is not installed: {INSTALL}",
            code="vision_unavailable",
        ) from None


def decode_image(data: bytes, param: str, detail: str | None = None) -> Any:
    """An RGB ``PIL.Image.Image`` upright per its EXIF orientation; transparency is laid on white."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        _check_pixels(image.width, image.height, "image", param)
        image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError) as e:
        if isinstance(e, Image.DecompressionBombError):
            raise _bomb(param) from None
        raise APIError(
            400,
            f"cannot read the image: send {', '.join(IMAGE_FORMATS)}",
            param=param,
            code="invalid_image",
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise APIError(400, f"the image is damaged: {e}", param=param, code="invalid_image") from None
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:  # a broken EXIF block: keep the pixels as stored
        pass
    image = _rgb(image)
    if detail == "low":
        image.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
    return image


def decode_video(
    data: bytes, param: str, fps: float, max_frames: int, fit: Callable | None = None
) -> tuple[list[Any], float]:
    """Up to ``max_frames`` RGB frames sampled ``fps`` times a second, and the rate they were sampled at:
    a video longer than ``max_frames / fps`` seconds gets ``max_frames`` frames spread over its length.
    ``fit(num_frames, width, height)``: the (width, height) to keep each frame at, or None (as decoded)."""
    import av
    from PIL import Image

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise APIError(400, "the file has no video stream", param=param, code="invalid_video")
            stream = container.streams.video[0]
            _check_pixels(stream.codec_context.width, stream.codec_context.height, "video frame", param)
            stream.thread_type = "AUTO"
            duration = _duration(container, stream)
            wanted = max_frames if duration is None else max(1, min(max_frames, math.ceil(duration * fps)))
            step = duration / wanted if duration is not None and wanted < duration * fps else 1 / fps
            frames: list[Any] = []
            start = None
            for frame in container.decode(stream):
                if frame.time is None:
                    continue
                start = frame.time if start is None else start
                if frame.time - start + 1e-6 < len(frames) * step:
                    continue
                _check_pixels(frame.width, frame.height, "video frame", param)
                image = frame.to_image().convert("RGB")
                size = fit(wanted, *image.size) if fit is not None else None
                if size is not None and size != image.size:
                    image = image.resize(size, Image.Resampling.BICUBIC)
                frames.append(image)
                if len(frames) >= wanted:
                    break
    except APIError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise APIError(
            400, f"cannot decode the video: {type(e).__name__}", param=param, code="invalid_video"
        ) from None
    if not frames:
        raise APIError(400, "the video has no frames", param=param, code="invalid_video")
    return frames, 1 / step


def _duration(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return None


def _check_pixels(width: int, height: int, what: str, param: str) -> None:
    if width * height > MAX_PIXELS:
        raise _bomb(param, f"the {what} is {width}x{height} pixels")


def _bomb(param: str, what: str = "the image is too large") -> APIError:
    return APIError(
        413, f"{what}; this server decodes at most {MAX_PIXELS} pixels", param=param, code="image_too_large"
    )


def _rgb(image):
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit grayscale: convert() would clip at 255
        import numpy as np

        levels = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8
        image = Image.fromarray(levels.astype(np.uint8), "L")
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
