"""Audio file bytes -> 16 kHz mono float32 samples with PyAV (the ``vision`` extra's video dependency).

The container is recognised from its first bytes (WAV, FLAC, MP3, Ogg, MP4/M4A, Matroska/WebM) and
opened with that demuxer only: FFmpeg's probing would also accept playlists and concat scripts that
name other files or URLs. The duration in the header is checked against ``max_seconds`` before any
sample is decoded, and decoding stops there too when a header lies or has no duration. Failures
raise ``AudioFileError`` with a ``code`` (invalid_audio, audio_too_long) for the caller to report.
"""

from __future__ import annotations

import io

import numpy as np

AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg", "m4a", "webm")
SAMPLE_RATE = 16000


class AudioFileError(ValueError):
    """An audio file that cannot be served; ``code``: "invalid_audio" or "audio_too_long"."""

    def __init__(self, message: str, code: str = "invalid_audio"):
        super().__init__(message)
        self.code = code


def sniff_format(data: bytes) -> str | None:
    """The FFmpeg demuxer for ``data``'s container, from its magic bytes; None when not an audio format
    trtedge reads."""
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def decode_audio_file(data: bytes, max_seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz (channels averaged). Raises ``AudioFileError`` for an
    unsupported, damaged or empty file, or one longer than ``max_seconds``."""
    import av

    demuxer = sniff_format(data)
    if demuxer is None:
        raise AudioFileError(f"unsupported audio format: send one of {', '.join(AUDIO_FORMATS)}")
    chunks: list[np.ndarray] = []
    limit = int(max_seconds * rate) + rate // 10  # a little slack for codec padding
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r", format=demuxer) as container:
            if not container.streams.audio:
                raise AudioFileError("the file has no audio stream")
            stream = container.streams.audio[0]
            seconds = _duration(container, stream)
            if seconds is not None and seconds > max_seconds:
                raise _too_long(seconds, max_seconds)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if total > limit:
                    raise _too_long(None, max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioFileError:
        raise
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise AudioFileError(f"cannot decode the audio: {type(e).__name__}") from None
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioFileError("the audio has no samples")
    if samples.size > limit:
        raise _too_long(samples.size / rate, max_seconds)
    if not np.isfinite(samples).all():
        raise AudioFileError("the audio decodes to samples that are not finite")
    return samples.astype(np.float32, copy=False)


def _duration(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return None


def _too_long(seconds: float | None, limit: float) -> AudioFileError:
    what = f"the audio is {seconds:.1f} s long" if seconds is not None else "the audio is longer than allowed"
    return AudioFileError(f"{what}; the limit is --max-audio-seconds {limit:g}", "audio_too_long")
