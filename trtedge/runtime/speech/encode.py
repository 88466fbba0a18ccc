"""Speech audio as bytes in a response format: ``pcm`` (raw signed 16-bit little-endian mono), ``wav``
(the same behind a RIFF header), and ``mp3``, ``opus`` (in Ogg), ``aac`` (ADTS) and ``flac`` encoded with
PyAV. ``Encoder.feed`` takes float32 samples in [-1, 1] as they are made and returns the bytes ready so
far; ``finish`` returns the rest."""

from __future__ import annotations

import struct

import numpy as np

FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
}
_CODECS = {
    "mp3": ("libmp3lame", "mp3"),
    "opus": ("libopus", "ogg"),
    "aac": ("aac", "adts"),
    "flac": ("flac", "flac"),
}


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(num_samples: int, sample_rate: int) -> bytes:
    """A 44-byte RIFF/WAVE header for mono 16-bit PCM of ``num_samples`` samples."""
    data = num_samples * 2
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


class _Sink:
    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class Encoder:
    """Streaming encoder of one answer. ``wav`` can only be written whole (its header holds the
    length): ``feed`` keeps the samples and ``finish`` returns the file."""

    def __init__(self, fmt: str, sample_rate: int):
        if fmt not in FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.format, self.rate = fmt, sample_rate
        self._held: list[bytes] = []
        self._pts = 0
        self._container = None
        if fmt in _CODECS:
            import av

            codec, container = _CODECS[fmt]
            self._sink = _Sink()
            self._container = av.open(self._sink, "w", format=container)
            self._stream = self._container.add_stream(codec, rate=sample_rate)
            self._stream.layout = "mono"

    def feed(self, samples: np.ndarray) -> bytes:
        if self.format == "pcm":
            return pcm16(samples)
        if self.format == "wav":
            self._held.append(pcm16(samples))
            return b""
        import av

        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples, np.float32)[None], format="flt", layout="mono"
        )
        frame.sample_rate, frame.pts = self.rate, self._pts
        self._pts += samples.shape[0]
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if self.format == "pcm":
            return b""
        if self.format == "wav":
            data = b"".join(self._held)
            return wav_header(len(data) // 2, self.rate) + data
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()

    def close(self) -> None:
        """Drop an unfinished encoding (the client went away)."""
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - nothing to report about an abandoned answer
                pass
            self._container = None
