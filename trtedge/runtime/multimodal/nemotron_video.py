"""Nemotron Omni's video front end: frames -> tubelet patches, and the prompt text around each tubelet.

Every frame of a video is resized (antialiased bicubic) to one aspect-preserving patch grid near
``video_target_num_patches`` (both sides multiples of 2, for the 2x2 pixel shuffle), normalised with
the processor's mean / std, and every ``temporal_patch_size`` consecutive frames (the last repeated to
fill) become one tubelet, stacked on the channel axis. In the prompt, the video's placeholder becomes
one segment per tubelet: ``Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: ``
``<img>`` + one token per 4 patches + ``</img>``, segments parted by a newline. A video of more
tubelets than ``max_tubelets`` is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trtedge.runtime.multimodal import MediaItem

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_TUBELETS = 128
NO_IMAGES = "Nemotron Omni is served with video input here; image input is not supported yet"


@dataclass(frozen=True)
class NemotronVideoProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    target_num_patches: int = 1024
    maintain_aspect_ratio: bool = True
    norm_mean: tuple[float, ...] = CLIP_MEAN
    norm_std: tuple[float, ...] = CLIP_STD
    max_tubelets: int = MAX_TUBELETS  # the most tubelets one video may take

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "target_num_patches", "max_tubelets"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"video_preprocessor_config.json: {name} must be a positive integer, got {value!r}"
                )

    @classmethod
    def from_dir(cls, path: Path, vision: dict) -> NemotronVideoProcessor:
        """From video_preprocessor_config.json (or processor_config.json's video_processor section), with
        the model's config (``vision``: ModelConfig.vision) for what it leaves out."""
        pre = _read_json(path / "video_preprocessor_config.json")
        pre = pre or _read_json(path / "processor_config.json").get("video_processor") or {}
        tower = vision.get("vision_config") or {}
        _check_profile(pre, tower, vision)
        return cls(
            patch_size=int(pre.get("patch_size", tower.get("patch_size", 16))),
            temporal_patch_size=int(
                vision.get("video_temporal_patch_size", pre.get("temporal_patch_size", 2))
            ),
            target_num_patches=int(pre.get("video_target_num_patches", 1024)),
            maintain_aspect_ratio=bool(pre.get("video_maintain_aspect_ratio", True)),
            norm_mean=tuple(float(v) for v in pre.get("norm_mean") or tower.get("norm_mean") or CLIP_MEAN),
            norm_std=tuple(float(v) for v in pre.get("norm_std") or tower.get("norm_std") or CLIP_STD),
            max_tubelets=int(pre.get("max_num_tubelets", MAX_TUBELETS)),
        )

    # ---- geometry ----------------------------------------------------------------------------------
    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of patches every frame of a ``width`` x ``height`` video is resized to."""
        target, div = self.target_num_patches, 2
        if not self.maintain_aspect_ratio:
            side = max(div, int(math.sqrt(target)) // div * div)
            return side, side
        aspect = width / max(height, 1)
        rows = max(round(math.sqrt(target / aspect)), 1)
        cols = max(round(math.sqrt(target * aspect)), 1)
        up_r, up_c = rows + (-rows % div), cols + (-cols % div)
        if up_r * up_c <= target:
            return up_r, up_c
        return max(div, rows - rows % div), max(div, cols - cols % div)

    def num_tubelets(self, num_frames: int) -> int:
        return -(-num_frames // self.temporal_patch_size)

    def video_size(self, num_frames: int, width: int, height: int) -> tuple[int, int]:
        """(height, width) in pixels the frames are resized to."""
        rows, cols = self.grid(width, height)
        return rows * self.patch_size, cols * self.patch_size

    def video_tokens(self, num_frames: int, width: int, height: int) -> int:
        """Placeholder tokens of a video of ``num_frames`` frames; ValueError past ``max_tubelets``."""
        tubelets = self.num_tubelets(num_frames)
        if tubelets > self.max_tubelets:
            raise ValueError(
                f"{num_frames} frames make {tubelets} tubelets of {self.temporal_patch_size} frames, more than "
                f"the {self.max_tubelets} one video may take; send fewer frames (a lower fps or nframes)"
            )
        rows, cols = self.grid(width, height)
        return tubelets * rows * cols // 4

    def image_tokens(self, width: int, height: int) -> int:
        raise ValueError(NO_IMAGES)

    def image_size(self, width: int, height: int) -> tuple[int, int]:
        raise ValueError(NO_IMAGES)

    def image(self, image, offset: int = 0) -> MediaItem:
        raise ValueError(NO_IMAGES)

    # ---- pixels -------------------------------------------------------------------------------------
    def video(self, frames: list, fps: float, offset: int = 0) -> MediaItem:
        """A video (PIL images or (H, W, 3) uint8 arrays, all one size, sampled at ``fps``) as one item:
        its tubelets' patches, flattened ((t * rows * cols, temporal * 3 * patch**2) float32)."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        arrays = [
            np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in frames
        ]
        if any(a.shape != arrays[0].shape or a.ndim != 3 or a.shape[2] != 3 for a in arrays):
            raise ValueError("every frame of a video must be an RGB image of the same size")
        height, width = arrays[0].shape[:2]
        self.video_tokens(len(arrays), width, height)  # refuses a video over the tubelet capacity
        rows, cols = self.grid(width, height)
        ps, tp = self.patch_size, self.temporal_patch_size
        x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float()
        if x.shape[-2:] != (rows * ps, cols * ps):
            x = F.interpolate(
                x, size=(rows * ps, cols * ps), mode="bicubic", align_corners=False, antialias=True
            )
        mean = torch.tensor(self.norm_mean).view(1, 3, 1, 1)
        std = torch.tensor(self.norm_std).view(1, 3, 1, 1)
        x = (x / 255.0 - mean) / std
        if len(x) % tp:
            x = torch.cat([x, x[-1:].expand(tp - len(x) % tp, -1, -1, -1)])
        t = len(x) // tp
        x = x.reshape(t, tp * 3, rows, ps, cols, ps).permute(0, 2, 4, 1, 3, 5)
        patches = x.reshape(t * rows * cols, tp * 3 * ps * ps).contiguous()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"nemotron-video:{t},{rows},{cols},{len(arrays)},{fps}".encode())
        digest.update(patches.numpy().tobytes())
        tokens = t * rows * cols // 4
        return MediaItem(
            "video",
            patches,
            (t, rows, cols),
            digest.digest(),
            offset,
            tokens,
            fps=float(fps),
            num_frames=len(arrays),
        )

    def frame_labels(self, item: MediaItem) -> list[str]:
        """The text before each tubelet's ``<img>``: its frames' numbers and times."""
        tp, fps = self.temporal_patch_size, item.fps
        step = int(1000.0 / fps) / 1000.0 if fps > 0 else None
        labels = []
        for g in range(item.grid[0]):
            parts = []
            for k in range(tp):
                i = g * tp + k
                if i >= item.num_frames:
                    break
                name = f"{'Frame' if k == 0 else 'frame'} {i + 1}"
                parts.append(f"{name} sampled at {i * step:.2f} seconds" if step is not None else name)
            labels.append(" and ".join(parts) + ": ")
        return labels


def video_segments(processor: NemotronVideoProcessor, tokenizer, start: int, end: int) -> Callable:
    """The PlaceholderTokens hook: for a video item, (ids before, ids after) each tubelet's tokens."""

    def segments(item: MediaItem) -> list[tuple[list[int], list[int]]]:
        out = []
        for g, label in enumerate(processor.frame_labels(item)):
            before = tokenizer.encode(("\n" if g else "") + label, add_special_tokens=False)
            out.append((before + [start], [end]))
        return out

    return segments


def _check_profile(pre: dict, tower: dict, vision: dict) -> None:
    """The processor's patches and tubelets must be the ones the tower embeds (checked at load)."""
    pairs = [
        ("patch_size", pre.get("patch_size"), "vision_config.patch_size", tower.get("patch_size")),
        (
            "temporal_patch_size",
            pre.get("temporal_patch_size"),
            "video_temporal_patch_size",
            vision.get("video_temporal_patch_size"),
        ),
        (
            "vision_config.video_temporal_patch_size",
            tower.get("video_temporal_patch_size"),
            "video_temporal_patch_size",
            vision.get("video_temporal_patch_size"),
        ),
    ]
    for name, value, other, expected in pairs:
        if value is not None and expected is not None and int(value) != int(expected):
            raise ValueError(
                f"the video processor's {name} ({value}) must equal the model's {other} ({expected})"
            )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
