"""Image and video input for vision-language models (Qwen2.5-VL).

The interface the server and ``LLM`` use:

- Chat messages may have list content with parts ``{"type": "text", "text": str}``,
  ``{"type": "image", "image": PIL.Image.Image}`` and
  ``{"type": "video", "video": list[PIL.Image.Image], "fps": float}`` (frames already sampled at
  ``fps`` by the caller).
- ``LLM.vision`` is None for a model (or bundle) without a vision component; otherwise a
  ``VisionProcessor`` with ``image_tokens(width, height)`` and ``video_tokens(num_frames, width,
  height)``: the placeholder tokens an image / a video of that size costs after the resize.
- ``LLM.encode_prompt(messages)`` returns ``list[int]`` when there are no media parts, else a
  ``MultimodalPrompt`` (``.ids`` with the placeholders expanded, ``.items`` the processed media with
  their content hashes); ``generate_stream`` and ``check_lengths(len(prompt.ids), ...)`` take it as
  they take ids.
- Media given to a model without a vision component raise ``ValueError("this model has no vision
  component ...")``; an image that cannot be processed raises a ValueError naming the content part
  (``messages[i].content[j]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One processed image or video: patches in the encoder's input layout and where its placeholder
    tokens sit in the prompt."""

    kind: str  # "image" | "video"
    pixels: torch.Tensor  # (num_patches, channels * temporal_patch_size * patch_size**2), float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    hash: bytes  # content hash of the pixels and grid: the identity used by context reuse and the cache
    offset: int  # index of the first placeholder token in the prompt ids
    num_tokens: int  # placeholder tokens (= encoder output rows)
    second_per_grid: float = 1.0  # videos: seconds covered by one temporal patch
    fps: float = 0.0  # videos: the rate the frames were sampled at
    num_frames: int = 1  # videos: frames given (before the last is repeated to fill a temporal patch)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def nbytes(self) -> int:
        return self.pixels.numel() * self.pixels.element_size()


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    """Prompt token ids with media placeholders expanded, the media items in prompt order, and the
    multimodal rotary positions of the prompt (3 rows: temporal, height, width)."""

    ids: list[int]
    items: tuple[MediaItem, ...]
    positions: torch.Tensor = field(repr=False)  # (3, len(ids)) long
    rope_delta: int = 0  # position of generated token i is len(ids) + i + rope_delta on every axis

    def __len__(self) -> int:
        return len(self.ids)


def has_media(messages) -> bool:
    """True when some message has a list content with an image or video part."""
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image", "video") for p in content
        ):
            return True
    return False


__all__ = ["MediaItem", "MultimodalPrompt", "has_media"]
