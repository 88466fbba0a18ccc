"""Chat messages with image / video / audio parts -> a MultimodalPrompt: each media part is processed,
the chat template renders its placeholder (one <|image_pad|> / <|video_pad|> / <|audio_pad|> token),
and each placeholder is expanded to the item's number of tokens; then the M-RoPE positions are
computed (models with M-RoPE only)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from trtedge.runtime.models.mrope import mrope_positions
from trtedge.runtime.multimodal import MEDIA_KINDS, MediaItem, MultimodalPrompt
from trtedge.runtime.multimodal.audio import AudioProcessor
from trtedge.runtime.multimodal.processor import VisionProcessor


@dataclass(frozen=True)
class PlaceholderTokens:
    """Token ids of the placeholders the chat template writes, and the encoder's geometry."""

    image: int | None
    video: int | None
    audio: int | None = None
    merge_size: int = 2
    tokens_per_second: float = 1.0
    # Qwen3-VL: each temporal patch of a video is its own segment, after its time as text:
    # "<t seconds>" <|vision_start|> pads <|vision_end|>; this encodes that text (None: one segment).
    timestamp_ids: Callable[[float], list[int]] | None = None
    vision_start: int = 151652
    vision_end: int = 151653
    mrope: bool = True  # the text model's rotary is M-RoPE (else the prompt keeps 1D positions)
    # Nemotron Omni: each tubelet of a video is its own segment, between the ids this returns for it
    # (its frames' label and <img>, then </img>); its tokens are ``video_pad`` (the image token)
    video_segments: Callable[[MediaItem], list[tuple[list[int], list[int]]]] | None = None
    video_pad: int | None = None


def placeholder_tokens(cfg, tokenizer) -> PlaceholderTokens:
    """The placeholders of a multimodal model's config (``ModelConfig.vision`` / ``.audio`` hold its
    config.json fields); Qwen3-VL writes each video frame pair after its time as text."""
    audio = int(cfg.audio.get("audio_token_id", 151676)) if cfg.audio is not None else None
    if cfg.vision is None:
        return PlaceholderTokens(image=None, video=None, audio=audio, mrope=bool(cfg.mrope_section))
    vision = cfg.vision
    if vision.get("family") == "nemotron_h_omni":
        return _nemotron_omni_tokens(vision, tokenizer)
    v = vision.get("vision_config") or {}
    timestamps = None
    if cfg.model_type == "qwen3_vl":

        def timestamps(seconds: float) -> list[int]:
            return tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)

    return PlaceholderTokens(
        image=int(vision.get("image_token_id", 151655)),
        video=int(vision.get("video_token_id", 151656)),
        merge_size=int(v.get("spatial_merge_size", 2)),
        tokens_per_second=float(v.get("tokens_per_second", 4)),
        timestamp_ids=timestamps,
        vision_start=int(vision.get("vision_start_token_id", 151652)),
        vision_end=int(vision.get("vision_end_token_id", 151653)),
        audio=audio,
    )


def _nemotron_omni_tokens(vision: dict, tokenizer) -> PlaceholderTokens:
    from trtedge.runtime.multimodal.nemotron_video import NemotronVideoProcessor, video_segments

    def token(name: str) -> int:
        i = tokenizer.token_to_id(name)
        if i is None:
            raise ValueError(f"the tokenizer has no {name} token (Nemotron Omni's video prompt needs it)")
        return i

    image = int(vision["image_token_id"]) if vision.get("image_token_id") is not None else token("<image>")
    video = int(vision["video_token_id"]) if vision.get("video_token_id") is not None else token("<video>")
    labels = NemotronVideoProcessor(temporal_patch_size=int(vision.get("video_temporal_patch_size", 2)))
    segments = video_segments(labels, tokenizer, token("<img>"), token("</img>"))
    return PlaceholderTokens(image=None, video=video, mrope=False, video_segments=segments, video_pad=image)


def process_media(
    messages: list[dict], processor: VisionProcessor | None, audio: AudioProcessor | None = None
) -> tuple[list[dict], list[MediaItem]]:
    """Messages with each image / video / audio part replaced by a bare ``{"type": ...}`` part for the
    template, and the processed items in prompt order (offsets not yet known)."""
    items: list[MediaItem] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_KINDS:
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            try:
                if kind == "audio":
                    if audio is None:
                        raise ValueError("this model has no audio component")
                    items.append(audio.audio(_samples(part.get("audio"))))
                elif processor is None:
                    raise ValueError("this model has no vision component")
                elif kind == "image":
                    items.append(processor.image(_pil(part.get("image"), where)))
                else:
                    frames = part.get("video")
                    if not isinstance(frames, (list, tuple)):
                        raise ValueError("'video' must be a list of PIL images")
                    frames = [_pil(f, where) for f in frames]
                    items.append(processor.video(frames, float(part.get("fps") or 0)))
            except (ValueError, TypeError, OSError) as e:
                raise ValueError(f"{where}: cannot process the {kind} ({e})") from None
            parts.append({"type": kind})
        out.append({**message, "content": parts})
    return out, items


def expand_placeholders(
    ids: list[int], items: list[MediaItem], tokens: PlaceholderTokens
) -> MultimodalPrompt:
    """Replace the i-th placeholder token of each kind by the i-th item of that kind's tokens."""
    pending = {kind: [it for it in items if it.kind == kind] for kind in MEDIA_KINDS}
    kinds = {
        t: kind for t, kind in zip((tokens.image, tokens.video, tokens.audio), MEDIA_KINDS) if t is not None
    }
    out: list[int] = []
    placed: list[MediaItem] = []
    for token in ids:
        kind = kinds.get(token)
        if kind is None:
            out.append(token)
            continue
        if not pending[kind]:
            raise ValueError(f"the prompt has more {kind} placeholders than {kind} parts")
        item = pending[kind].pop(0)
        if kind == "video" and tokens.video_segments is not None:
            pad = token if tokens.video_pad is None else tokens.video_pad
            for (before, after), frame in zip(tokens.video_segments(item), split_frames(item)):
                out.extend(before)
                placed.append(dataclasses.replace(frame, offset=len(out)))
                out.extend([pad] * frame.num_tokens)
                out.extend(after)
            continue
        if kind == "video" and tokens.timestamp_ids is not None:
            for time, frame in zip(frame_times(item), split_frames(item)):
                out.extend(tokens.timestamp_ids(time))
                out.append(tokens.vision_start)
                placed.append(dataclasses.replace(frame, offset=len(out)))
                out.extend([token] * frame.num_tokens)
                out.append(tokens.vision_end)
            continue
        placed.append(dataclasses.replace(item, offset=len(out)))
        out.extend([token] * item.num_tokens)
    missing = [k for k, left in pending.items() if left]
    if missing:
        raise ValueError(
            f"the chat template placed no placeholder for some {missing[0]} parts "
            "(it must write <|vision_start|><|image_pad|><|vision_end|> for each image, "
            "<|audio_start|><|audio_pad|><|audio_end|> for each audio clip)"
        )
    if not tokens.mrope:
        return MultimodalPrompt(out, tuple(placed), None, 0)
    merge = tokens.merge_size
    spans = [
        (
            it.offset,
            (it.grid[0], it.grid[1] // merge, it.grid[2] // merge),
            tokens.tokens_per_second * it.second_per_grid if it.kind == "video" else 1.0,
        )
        for it in placed
    ]
    positions, delta = mrope_positions(len(out), spans)
    return MultimodalPrompt(out, tuple(placed), positions, delta)


def _samples(value):
    import numpy as np

    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.size == 0:
        raise ValueError("'audio' must be a non-empty 1D numpy array of mono samples")
    if not np.isfinite(value).all():
        raise ValueError("the audio has samples that are not finite")
    return value.astype(np.float32, copy=False)


def _pil(value, where: str):
    from PIL import Image

    if not isinstance(value, Image.Image):
        raise ValueError(f"expected a PIL image, got {type(value).__name__}")
    return value


def frame_times(item: MediaItem) -> list[float]:
    """Seconds at the middle of each temporal patch of a video (frames sampled evenly from 0)."""
    per = round(item.second_per_grid * item.fps)  # frames per temporal patch
    last = item.num_frames - 1
    indices = [min(i, last) for i in range(item.grid[0] * per)]  # the last frame repeats to fill
    return [(indices[g * per] + indices[g * per + per - 1]) / 2 / item.fps for g in range(item.grid[0])]


def split_frames(item: MediaItem) -> list[MediaItem]:
    """A video as one item per temporal patch (the encoder attends within a frame, so the embeddings
    are the same as the whole video's)."""
    t, h, w = item.grid
    per = h * w
    frames = []
    for g in range(t):
        digest = hashlib.blake2b(item.hash + g.to_bytes(4, "little"), digest_size=16).digest()
        pixels = item.pixels[g * per : (g + 1) * per]
        frames.append(
            dataclasses.replace(
                item, pixels=pixels, grid=(1, h, w), hash=digest, num_tokens=item.num_tokens // t
            )
        )
    return frames
