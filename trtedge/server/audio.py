"""Audio in requests: PyAV present (501 otherwise), and files decoded to 16 kHz mono samples
(``runtime.multimodal.audio_file``) with their failures as 400s naming the part."""

from __future__ import annotations

import numpy as np

from trtedge.runtime.multimodal.audio_file import (
    AUDIO_FORMATS,
    SAMPLE_RATE,
    AudioFileError,
    decode_audio_file,
)
from trtedge.server.errors import APIError

__all__ = ["AUDIO_FORMATS", "decode_audio", "require_av"]
_INSTALL = "pip install 'trtedge[vision]'"


def require_av() -> None:
    """501 naming the extra to install when PyAV is missing."""
    try:
        import av  # noqa: F401
    except ImportError:
        raise APIError(
            501, f"audio input needs PyAV, which is not installed: {_INSTALL}", code="audio_unavailable"
        ) from None


def decode_audio(data: bytes, param: str, max_seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz; 400 naming ``param`` for an unsupported, damaged or empty
    file (invalid_audio), or one longer than ``max_seconds`` (audio_too_long)."""
    try:
        return decode_audio_file(data, max_seconds, rate)
    except AudioFileError as e:
        raise APIError(400, str(e), param=param, code=e.code) from None
