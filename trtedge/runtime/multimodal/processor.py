"""The Qwen2-VL / Qwen2.5-VL image and video processor: resize to the pixel limits (a multiple of
patch_size x merge_size on each side), rescale and normalise, then cut into the flat patch layout
the vision encoder reads: (grid_t x grid_h x grid_w) rows of channels x temporal_patch_size x
patch_size^2 values, with the patches of each merge_size^2 block adjacent. An image is one frame
repeated to temporal_patch_size frames; a video's frames are grouped temporal_patch_size at a time
(the last frame repeated to fill the last group)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trtedge.runtime.multimodal import MediaItem

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with the area within [min_pixels, max_pixels]
    and the aspect ratio kept as closely as possible (Qwen2-VL's rule)."""
    if min(height, width) < 1:
        raise ValueError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of a {width}x{height} image is over 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def clip_resize(
    num_frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``smart_resize`` with the limits on frames x height x width (Qwen3-VL's video rule)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of a {width}x{height} video is over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class VisionProcessor:
    """Turns PIL images and video frames into ``MediaItem``s; counts placeholder tokens."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    video_clip_budget: bool = False  # Qwen3-VL: the video pixel limits bound the whole clip
    max_video_frame_tokens: int = 768

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"preprocessor_config.json: {name} must be a positive integer, got {value!r}"
                )
        if self.min_pixels > self.max_pixels:
            raise ValueError("preprocessor_config.json: min_pixels is above max_pixels")

    @classmethod
    def from_dir(cls, path: Path, vision_config: dict, video_clip_budget: bool = False) -> VisionProcessor:
        """From preprocessor_config.json (and video_preprocessor_config.json) where present, with the
        encoder's patch sizes from the model's vision_config as defaults."""
        image = _read_json(path / "preprocessor_config.json")
        video = _read_json(path / "video_preprocessor_config.json") or image
        kw = dict(
            patch_size=int(image.get("patch_size", vision_config.get("patch_size", 14))),
            merge_size=int(image.get("merge_size", vision_config.get("spatial_merge_size", 2))),
            temporal_patch_size=int(
                image.get("temporal_patch_size", vision_config.get("temporal_patch_size", 2))
            ),
            image_mean=tuple(float(x) for x in image.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(float(x) for x in image.get("image_std", _CLIP_STD)),
            rescale_factor=float(image.get("rescale_factor", 1 / 255)),
        )
        lo, hi = _pixel_limits(image, 56 * 56, 28 * 28 * 1280)
        vlo, vhi = _pixel_limits(video, 128 * 28 * 28, 768 * 28 * 28) if video is not image else (lo, hi)
        kw["max_video_frame_tokens"] = int(video.get("max_video_tokens", 768))
        return cls(
            min_pixels=lo,
            max_pixels=hi,
            video_min_pixels=vlo,
            video_max_pixels=vhi,
            video_clip_budget=video_clip_budget,
            **kw,
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def image_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image is resized to."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return w, h

    def image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens one image of this size costs."""
        w, h = self.image_size(width, height)
        return (h // self.factor) * (w // self.factor)

    def video_tokens(self, num_frames: int, width: int, height: int) -> int:
        """Placeholder tokens a video of ``num_frames`` frames of this size costs."""
        h, w = self.video_size(num_frames, width, height)
        grid_t = -(-max(num_frames, 1) // self.temporal_patch_size)
        return grid_t * (h // self.factor) * (w // self.factor)

    def video_size(self, num_frames: int, width: int, height: int) -> tuple[int, int]:
        """(height, width) the frames of a video are resized to: within the video pixel limits per
        frame, or (``video_clip_budget``, Qwen3-VL) within a budget for the whole clip of
        min(max_video_frame_tokens per frame, video_max_pixels / frames), at least 1.05 x
        video_min_pixels per frame (qwen-vl-utils' rule)."""
        # fewer frames than a temporal patch are padded to one (HF refuses them): size them as padded
        f, n = self.factor, max(num_frames, self.temporal_patch_size)
        if not self.video_clip_budget:
            return smart_resize(height, width, f, self.video_min_pixels, self.video_max_pixels)
        per_frame = max(
            min(self.max_video_frame_tokens * f * f, self.video_max_pixels // n),
            int(self.video_min_pixels * 1.05),
        )
        return clip_resize(
            n, height, width, self.temporal_patch_size, f, self.video_min_pixels, per_frame * n
        )

    def image(self, image, offset: int = 0) -> MediaItem:
        """A PIL image as a MediaItem (one frame repeated to temporal_patch_size)."""
        h, w = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
        frame = self._frame(image, w, h)
        return self._item("image", np.repeat(frame[None], self.temporal_patch_size, axis=0), offset)

    def video(self, frames: list, fps: float, offset: int = 0) -> MediaItem:
        """Frames (PIL images, sampled at ``fps``) as a MediaItem; all are resized to the first's size."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        if not fps or fps <= 0:
            raise ValueError(f"video fps must be positive, got {fps!r}")
        h, w = self.video_size(len(frames), frames[0].width, frames[0].height)
        stack = [self._frame(f, w, h) for f in frames]
        stack += [stack[-1]] * (-len(stack) % self.temporal_patch_size)
        item = self._item("video", np.stack(stack), offset, self.temporal_patch_size / fps)
        return dataclasses.replace(item, fps=float(fps), num_frames=len(frames))

    def _frame(self, image, width: int, height: int) -> np.ndarray:
        from PIL import Image

        image = image.convert("RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BICUBIC)
        x = np.asarray(image, dtype=np.float32) * np.float32(self.rescale_factor)
        x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return x.transpose(2, 0, 1)  # (C, H, W)

    def _item(self, kind: str, frames: np.ndarray, offset: int, second_per_grid: float = 1.0) -> MediaItem:
        """(T, C, H, W) normalised frames -> patches in the encoder's layout."""
        t, c, h, w = frames.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gt, gh, gw = t // tp, h // p, w // p
        x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, c, tp, p, p)
        pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p))
        grid = (gt, gh, gw)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{kind}:{grid}:{second_per_grid}".encode())
        digest.update(pixels.numpy().tobytes())
        num_tokens = gt * gh * gw // (m * m)
        return MediaItem(kind, pixels, grid, digest.digest(), offset, num_tokens, second_per_grid)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _pixel_limits(cfg: dict, lo: int, hi: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or lo
    hi = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or hi
    return int(lo), int(hi)
