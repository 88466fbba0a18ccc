"""Image, video and audio input for multimodal models (Qwen2.5-VL, Qwen3-VL, Qwen3-ASR).

The interface the server and ``LLM`` use:

- Chat messages may have list content with parts ``{"type": "text", "text": str}``,
  ``{"type": "image", "image": PIL.Image.Image}`` and
  ``{"type": "video", "video": list[PIL.Image.Image], "fps": float}`` (frames already sampled at
  ``fps`` by the caller) and ``{"type": "audio", "audio": numpy float32 array}`` (mono samples at
  ``LLM.audio.sampling_rate``, 16 kHz).
- ``LLM.vision`` is None for a model (or bundle) without a vision component; otherwise a
  ``VisionProcessor`` with ``image_tokens(width, height)`` and ``video_tokens(num_frames, width,
  height)``: the placeholder tokens an image / a video of that size costs after the resize.
- ``LLM.encode_prompt(messages)`` returns ``list[int]`` when there are no media parts, else a
  ``MultimodalPrompt`` (``.ids`` with the placeholders expanded, ``.items`` the processed media with
  their content hashes); ``generate_stream`` and ``check_lengths(len(prompt.ids), ...)`` take it as
  they take ids.
- ``LLM.audio`` is None for a model without an audio encoder; otherwise an ``AudioProcessor`` with
  ``audio_tokens(num_samples)``.
- Media given to a model without a vision component raise ``ValueError("this model has no vision
  component ...")`` (audio: "... no audio component ..."); an image that cannot be processed raises a ValueError naming the content part
  (``messages[i].content[j]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One processed image, video or audio clip: its encoder input and where its placeholder tokens sit
    in the prompt."""

    kind: str  # "image" | "video" | "audio"
    # images and videos: (num_patches, channels * temporal_patch_size * patch_size**2) patches;
    # audio: (frames, mel bins) log-mel features; float32
    pixels: torch.Tensor
    grid: tuple[int, int, int]  # (t, h, w) in patches; audio: (1, frames, mel bins)
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
    multimodal rotary positions of the prompt (3 rows: temporal, height, width; None for a model with
    plain 1D rotary, e.g. Qwen3-ASR)."""

    ids: list[int]
    items: tuple[MediaItem, ...]
    positions: torch.Tensor | None = field(repr=False)  # (3, len(ids)) long
    rope_delta: int = 0  # position of generated token i is len(ids) + i + rope_delta on every axis

    def __len__(self) -> int:
        return len(self.ids)


# Tensors of a multimodal model's media encoders (the Qwen-VL vision towers; Qwen3-ASR's audio tower and
# projector): the bundle's encoder component holds them, and they stay float.
ENCODER_PREFIXES = (
    "visual.",
    "model.visual.",
    "audio_tower.",
    "model.audio_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "thinker.audio_tower.",  # Qwen2.5-Omni's thinker
    "thinker.visual.",
    "vision_model.",  # Nemotron Omni's RADIO tower, its projector (mlp1.) and final norm
    "vision_final_layernorm.",
    "vision_projector.",
    "mlp1.",
)


# Parts of a checkpoint the language model does not hold: Qwen2.5-Omni's talker and vocoder, Qwen3-Omni's
# (the bundle's speech components, runtime.speech, hold those).
UNSERVED_PREFIXES = ("talker.", "token2wav.", "code2wav.")


def is_unserved_tensor(name: str) -> bool:
    return name.startswith(UNSERVED_PREFIXES)


def is_encoder_tensor(name: str) -> bool:
    return name.startswith(ENCODER_PREFIXES)


MEDIA_KINDS = ("image", "video", "audio")


def media_kinds(messages) -> set[str]:
    """The kinds of media parts in ``messages`` ("image", "video", "audio")."""
    kinds = set()
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            kinds.update(
                p.get("type") for p in content if isinstance(p, dict) and p.get("type") in MEDIA_KINDS
            )
    return kinds


def has_media(messages) -> bool:
    """True when some message has a list content with an image, video or audio part."""
    return bool(media_kinds(messages))


__all__ = [
    "ENCODER_PREFIXES",
    "MEDIA_KINDS",
    "MediaItem",
    "MultimodalPrompt",
    "has_media",
    "is_encoder_tensor",
    "is_unserved_tensor",
    "media_kinds",
]
