"""The image, video and audio parts of a chat request, loaded for ``LLM.encode_prompt``.

``load_media`` runs before the request takes an admission seat, so every refusal costs nothing: a model
without a vision (or audio) component (400), Pillow / PyAV missing (501), then part by part: the source
(media.py: 403 / 404 / 413 / 400), decoding (decoding.py, audio.py: 400 / 413) and the image-token
limits (400 naming the flag). Fetching is async; decoding and the vision processor run on a small pool of worker threads
(``in_media_thread``), so the event loop never waits on them and a burst of media requests cannot take
every thread of the process.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trtedge.runtime.multimodal.nemotron_video import NO_IMAGES, NemotronVideoProcessor
from trtedge.server.audio import AUDIO_FORMATS, decode_audio, require_av
from trtedge.server.core import ServingCore
from trtedge.server.decoding import decode_image, decode_video, require
from trtedge.server.errors import APIError, bad_request
from trtedge.server.media import fetch_media
from trtedge.server.openai.protocol import (
    AudioURL,
    ChatCompletionRequest,
    ContentPart,
    ImageURL,
    InputAudio,
    VideoURL,
)

MEDIA_PARTS = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}
DEFAULT_FPS = 2.0
MAX_FPS = 60.0  # the request's fps limit (protocol.VideoURL)
NO_VISION = "this model has no vision component; image and video inputs cannot be served"
NO_AUDIO = "this model has no audio component; audio inputs cannot be served"
_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}

MEDIA_THREADS = 4
_POOL = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="trtedge-media")

Media = dict[tuple[int, int], dict]  # (message, part) -> {"type": "image", ...} | {"type": "video", ...}


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request, where it sits and what it asks for."""

    where: tuple[int, int]
    kind: str  # "image" | "video" | "audio"
    url: str
    param: str  # the request field errors about this part name
    detail: str | None = None
    fps: float | None = None
    nframes: int | None = None


def media_refs(req: ChatCompletionRequest) -> list[MediaRef]:
    """The request's image, video and audio parts, in order; a media part outside a user message is a 400."""
    refs = []
    for i, m in enumerate(req.messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type in MEDIA_PARTS:
                param = req._media_params.get((i, j)) or f"messages.{i}.content.{j}.{part.type}"
                refs.append(_ref(part, (i, j), param, m.role))
    return refs


def _ref(part: ContentPart, where: tuple[int, int], param: str, role: str) -> MediaRef:
    kind = MEDIA_PARTS[part.type]
    source = getattr(part, part.type)
    if source is None:
        raise bad_request(
            f'an {part.type} part needs {part.type!r}: {{"url": ...}}', param=param, code="invalid_value"
        )
    if role != "user":
        raise bad_request(f"only user messages may carry {kind}s", param=param, code="invalid_value")
    if isinstance(source, InputAudio):
        if source.format.lower() not in AUDIO_FORMATS:
            raise bad_request(
                f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)}, got {source.format!r}",
                param=f"{param}.format",
                code="invalid_value",
            )
        mime = _AUDIO_MIME.get(source.format.lower(), f"audio/{source.format.lower()}")
        return MediaRef(where, kind, f"data:{mime};base64,{source.data}", param)
    if isinstance(source, AudioURL):
        return MediaRef(where, kind, source.url, param)
    if isinstance(source, str):
        return MediaRef(where, kind, source, param)
    if isinstance(source, ImageURL):
        return MediaRef(where, kind, source.url, param, detail=source.detail)
    assert isinstance(source, VideoURL)
    return MediaRef(where, kind, source.url, param, fps=source.fps, nframes=source.nframes)


async def load_media(serving: ServingCore, req: ChatCompletionRequest) -> Media:
    """The decoded pictures of every media part, as template content parts; {} for a text-only request."""
    refs = media_refs(req)
    if not refs:
        return {}
    vision, audio = serving.llm.vision, serving.llm.audio
    pictures = [r for r in refs if r.kind != "audio"]
    if pictures and vision is None:
        raise bad_request(NO_VISION, param=pictures[0].param, code="no_vision_component")
    clips = [r for r in refs if r.kind == "audio"]
    if clips and audio is None:
        raise bad_request(NO_AUDIO, param=clips[0].param, code="no_audio_component")
    if not req.apply_chat_template:
        raise bad_request(
            "images, videos and audio need the chat template: drop apply_chat_template=false",
            param="apply_chat_template",
            code="invalid_value",
        )
    if isinstance(vision, NemotronVideoProcessor) and pictures:
        _check_one_video(pictures, vision, serving.config.max_video_frames)
    if pictures:
        require(video=any(r.kind == "video" for r in refs))
    if clips:
        require_av()
    config = serving.config
    media: Media = {}
    total = 0
    for ref in refs:
        data = await fetch_media(ref.url, config, ref.param, audio=ref.kind == "audio")
        if ref.kind == "audio":
            samples = await in_media_thread(
                decode_audio, data, ref.param, config.max_audio_seconds, audio.sampling_rate
            )
            part: dict[str, Any] = {"type": "audio", "audio": samples}
            tokens = audio.audio_tokens(samples.size)
        elif ref.kind == "image":
            image, tokens = await in_media_thread(_decode_fitted, data, ref, vision)
            part = {"type": "image", "image": image}
        else:
            limit = min(ref.nframes or config.max_video_frames, config.max_video_frames)
            fit = functools.partial(_frame_size, vision)
            if isinstance(vision, NemotronVideoProcessor):
                fit = functools.partial(_omni_frames, vision, ref.param)
            # nframes alone: that many frames spread over the whole video (the highest rate, capped)
            fps = ref.fps or (
                MAX_FPS if ref.nframes and isinstance(vision, NemotronVideoProcessor) else DEFAULT_FPS
            )
            frames, fps = await in_media_thread(decode_video, data, ref.param, fps, limit, fit)
            part = {"type": "video", "video": frames, "fps": fps}
            tokens = _tokens(vision.video_tokens, ref, len(frames), *frames[0].size)
        del data
        total += tokens
        if ref.kind != "audio":
            _check_tokens(config, ref, tokens, total)
        max_input_len = serving.llm.config.max_input_len
        if total > max_input_len:  # the prompt is refused anyway: stop holding pictures for it
            raise APIError(
                400,
                f"the request's media take {total} tokens (so far), more than max_input_len {max_input_len}",
                param=ref.param,
                code="context_length_exceeded",
            )
        media[ref.where] = part
    return media


def _check_one_video(pictures: list[MediaRef], vision: NemotronVideoProcessor, max_frames: int) -> None:
    """Nemotron Omni: one video and no image per request, fps or nframes (not both), and a frame count
    within the tubelet capacity, all before anything is fetched or decoded."""
    videos = [r for r in pictures if r.kind == "video"]
    if not videos:
        raise bad_request(NO_IMAGES, param=pictures[0].param, code="invalid_media")
    for ref in pictures:
        if ref.kind == "image" or ref is not videos[0]:
            what = "an image" if ref.kind == "image" else "a second video"
            raise bad_request(
                f"this model takes one video and no image per request; {what} is here",
                param=ref.param,
                code="invalid_media",
            )
    ref = videos[0]
    if ref.fps is not None and ref.nframes is not None:
        raise bad_request(
            "send fps or nframes, not both: fps samples that many frames a second, nframes that many frames "
            "over the whole video",
            param=f"{ref.param}.nframes",
            code="invalid_value",
        )
    frames = min(ref.nframes or max_frames, max_frames)
    if ref.nframes is not None and vision.num_tubelets(frames) > vision.max_tubelets:
        raise bad_request(
            f"nframes {ref.nframes} makes {vision.num_tubelets(frames)} tubelets, more than the "
            f"{vision.max_tubelets} one video may take",
            param=f"{ref.param}.nframes",
            code="invalid_value",
        )


def _omni_frames(
    vision: NemotronVideoProcessor, param: str, num_frames: int, width: int, height: int
) -> None:
    """Nemotron Omni's ``fit``: at the first frame, the video's frame count is checked against the
    tubelet capacity (before the rest is decoded); the frames stay as decoded, for the processor's
    own antialiased resize."""
    try:
        vision.video_tokens(num_frames, width, height)
    except ValueError as e:
        raise bad_request(str(e), param=param, code="invalid_media") from None
    return None


def _decode_fitted(data: bytes, ref: MediaRef, vision) -> tuple[Any, int]:
    """The decoded image resized to the size the vision processor takes it at (what it would do
    itself, done here so that a request holds small pictures, not its decoded canvases), and its tokens."""
    from PIL import Image

    image = decode_image(data, ref.param, ref.detail)
    tokens = _tokens(vision.image_tokens, ref, *image.size)
    size = vision.image_size(*image.size)
    if size != image.size and _fixed_point(vision, size):  # the processor will not resize it again
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image, tokens


def _frame_size(vision, num_frames: int, width: int, height: int) -> tuple[int, int] | None:
    """The (width, height) the processor takes the frames of a video of ``num_frames`` frames at."""
    try:
        h, w = vision.video_size(num_frames, width, height)
        fixed = vision.video_size(num_frames, w, h) == (h, w)
    except ValueError:  # refused with its reason by the token count
        return None
    return (w, h) if fixed else None


def _fixed_point(vision, size: tuple[int, int]) -> bool:
    try:  # not for extreme aspect ratios, where the resized shape would be rounded once more
        return vision.image_size(*size) == size
    except ValueError:
        return False


def _tokens(count, ref: MediaRef, *size: int) -> int:
    try:
        return count(*size)
    except ValueError as e:  # the processor refuses this shape (e.g. an extreme aspect ratio)
        raise bad_request(
            f"the model cannot take this {ref.kind}: {e}", param=ref.param, code="invalid_media"
        ) from None


async def in_media_thread(fn, *args):
    """``fn(*args)`` on the media worker pool."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


def _check_tokens(config, ref: MediaRef, tokens: int, total: int) -> None:
    per_item = config.max_image_tokens_per_image
    if per_item is not None and tokens > per_item:
        raise APIError(
            400,
            f"this {ref.kind} takes {tokens} image tokens, more than --max-image-tokens-per-image "
            f"{per_item}; send it smaller"
            + (" or with fewer frames (nframes)" if ref.kind == "video" else ""),
            param=ref.param,
            code="too_many_image_tokens",
        )
    if config.max_image_tokens is not None and total > config.max_image_tokens:
        raise APIError(
            400,
            f"the request's images and videos take {total} image tokens (so far), more than "
            f"--max-image-tokens {config.max_image_tokens}",
            param=ref.param,
            code="too_many_image_tokens",
        )


def media_part(url: str, param: str, detail: str | None = None) -> dict:
    """An OpenAI image_url part for a translated request (Anthropic, Responses); ``param`` is where the image
    sits in the client's own request, taken out again by ``take_media_params``."""
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url, _PARAM: param}


def audio_part(data: str, fmt: str, param: str) -> dict:
    """An OpenAI input_audio part for a translated request (Responses), marked like ``media_part``."""
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}, _PARAM: param}


def take_media_params(messages: list[dict]) -> dict[tuple[int, int], str]:
    """(message, part) -> param of every ``media_part`` in ``messages``, removing the marks."""
    params = {}
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if _PARAM in part:
                    params[i, j] = part.pop(_PARAM)
    return params


_PARAM = "__param"
