"""Audio files -> 16 kHz mono samples (runtime.multimodal.audio_file): containers recognised by their
first bytes only, durations checked before decoding and again while decoding."""

from __future__ import annotations

import pytest

from trtedge.runtime.multimodal import audio_file
from trtedge.runtime.multimodal.audio_file import AudioFileError, decode_audio_file, sniff_format

pytest.importorskip("av")
tiny_asr = pytest.importorskip("tests.tiny_asr")


@pytest.mark.parametrize(
    ("fmt", "demuxer"),
    [("wav", "wav"), ("flac", "flac"), ("mp3", "mp3"), ("ogg", "ogg"), ("m4a", "mp4"), ("webm", "matroska")],
)
def test_containers_are_recognised_from_their_bytes(fmt, demuxer):
    assert sniff_format(tiny_asr.encode_clip(tiny_asr.tone(0.3), fmt)) == demuxer


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"hello",
        b"#EXTM3U\nfile:///etc/passwd\n",
        b"ffconcat version 1.0\nfile /etc/passwd\n",
        b"\x89PNG\r\n",
    ],
)
def test_anything_else_is_refused_before_ffmpeg_reads_it(data):
    assert sniff_format(data) is None
    with pytest.raises(AudioFileError, match="unsupported audio format") as e:
        decode_audio_file(data, 60.0)
    assert e.value.code == "invalid_audio"


def test_the_header_duration_is_checked_first_and_decoding_stops_at_the_limit(monkeypatch):
    clip = tiny_asr.encode_clip(tiny_asr.tone(3.0), "flac")
    with pytest.raises(AudioFileError, match="3.0 s long") as e:
        decode_audio_file(clip, 2.0)
    assert e.value.code == "audio_too_long"
    decoded = []
    real = audio_file.np.concatenate

    def counting(chunks, *args, **kwargs):
        decoded.append(sum(c.size for c in chunks))
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(audio_file, "_duration", lambda container, stream: None)  # a header without one
    monkeypatch.setattr(audio_file.np, "concatenate", counting)
    with pytest.raises(AudioFileError, match="longer than allowed") as e:
        decode_audio_file(clip, 1.0)
    assert e.value.code == "audio_too_long" and not decoded  # stopped inside the decode loop
    assert decode_audio_file(clip, 4.0).size == 48000
