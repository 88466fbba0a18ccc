"""Audio front ends: 16 kHz mono samples -> a log-mel spectrogram (Whisper's recipe: a 400-point Hann
STFT every 160 samples, 128 Slaney mel filters up to 8 kHz, log10 floored 8 below the clip's peak,
then (x + 4) / 4), and the number of placeholder tokens the encoder turns it into.

- Qwen3-ASR (``AudioProcessor``): the frames are cut into chunks of 2 x n_window, three stride-2
  convolutions leave ceil(n / 8) tokens of a chunk of n frames (13 of a full chunk of 100).
- Qwen2.5-Omni (``WhisperAudioProcessor``): Whisper's extractor, the clip zero-padded to 30 s (at
  most 30 s), ceil(samples / 160) frames; a stride-2 convolution and a pooling by 2 leave about a
  quarter of them as tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trtedge.runtime.multimodal import MediaItem

SAMPLE_RATE = 16000


def mel_filters(num_bins: int, num_mels: int, sample_rate: int, fmin: float, fmax: float) -> np.ndarray:
    """(num_bins, num_mels) triangular filters on the Slaney mel scale, Slaney-normalised (float64)."""
    mels = np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), num_mels + 2)
    edges = _mel_to_hz(mels)
    bins = np.linspace(0, sample_rate // 2, num_bins)
    width = np.diff(edges)
    slopes = edges[None, :] - bins[:, None]
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


_LOG_STEP = 27.0 / np.log(6.4)


def _hz_to_mel(hz):
    hz = np.asarray(hz, dtype=np.float64)
    mel = 3.0 * hz / 200.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * _LOG_STEP, mel)


def _mel_to_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((mel - 15.0) / _LOG_STEP), 200.0 * mel / 3.0)


@dataclass(frozen=True)
class AudioProcessor:
    """Turns 16 kHz mono float32 samples into ``MediaItem``s of kind "audio" (their log-mel frames,
    (frames, num_mel_bins)); counts placeholder tokens."""

    num_mel_bins: int = 128
    sampling_rate: int = SAMPLE_RATE
    n_fft: int = 400
    hop_length: int = 160
    n_window: int = 50  # half an encoder chunk, in mel frames
    min_length: int = 8000  # shorter clips are zero-padded to this many samples (as the reference)
    transcription: str = "qwen3_asr"  # how a transcription is asked for (runtime.multimodal.transcription)
    filters: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_mel_bins", "sampling_rate", "n_fft", "hop_length", "n_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"preprocessor_config.json: {name} must be a positive integer, got {value!r}"
                )
        fb = mel_filters(1 + self.n_fft // 2, self.num_mel_bins, self.sampling_rate, 0.0, 8000.0)
        object.__setattr__(self, "filters", torch.from_numpy(fb).to(torch.float32))

    @classmethod
    def from_dir(cls, path: Path, audio_config: dict) -> AudioProcessor:
        """From preprocessor_config.json where present, the mel bins and chunk size of the encoder's
        audio_config as defaults."""
        try:
            pre = json.loads((path / "preprocessor_config.json").read_text())
        except FileNotFoundError:
            pre = {}
        return cls(
            num_mel_bins=int(pre.get("feature_size", audio_config.get("num_mel_bins", 128))),
            sampling_rate=int(pre.get("sampling_rate", SAMPLE_RATE)),
            n_fft=int(pre.get("n_fft", 400)),
            hop_length=int(pre.get("hop_length", 160)),
            n_window=int(pre.get("n_window", audio_config.get("n_window", 50))),
            min_length=int(pre.get("min_length", 8000)),
        )

    def num_frames(self, num_samples: int) -> int:
        return max(num_samples, self.min_length) // self.hop_length

    def audio_tokens(self, num_samples: int) -> int:
        """Placeholder tokens a clip of ``num_samples`` samples costs."""
        frames = self.num_frames(num_samples)
        chunk = 2 * self.n_window
        full, rest = divmod(frames, chunk)
        return full * conv_length(chunk) + conv_length(rest)

    def features(self, samples: np.ndarray) -> torch.Tensor:
        """(frames, num_mel_bins) float32 log-mel features of a mono clip."""
        x = torch.as_tensor(np.ascontiguousarray(samples, dtype=np.float32))
        if x.dim() != 1 or x.numel() == 0:
            raise ValueError("audio must be a non-empty 1D array of mono samples")
        if x.numel() < self.min_length:
            x = torch.nn.functional.pad(x, (0, self.min_length - x.numel()))
        return self._log_mel(x)

    def _log_mel(self, x: torch.Tensor) -> torch.Tensor:
        window = torch.hann_window(self.n_fft)
        stft = torch.stft(x, self.n_fft, self.hop_length, window=window, return_complex=True)
        power = stft[..., :-1].abs() ** 2
        mel = self.filters.T @ power
        log = torch.clamp(mel, min=1e-10).log10()
        log = torch.maximum(log, log.max() - 8.0)
        return ((log + 4.0) / 4.0).T.contiguous()

    def audio(self, samples: np.ndarray, offset: int = 0) -> MediaItem:
        """A clip (16 kHz mono float32 samples) as a MediaItem."""
        feats = self.features(samples)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"audio:{tuple(feats.shape)}".encode())
        digest.update(feats.numpy().tobytes())
        tokens = self.audio_tokens(int(np.asarray(samples).shape[0]))
        grid = (1, feats.shape[0], feats.shape[1])
        return MediaItem("audio", feats, grid, digest.digest(), offset, tokens)


@dataclass(frozen=True)
class WhisperAudioProcessor(AudioProcessor):
    """Qwen2.5-Omni's front end (Whisper's feature extractor): every clip is zero-padded to
    ``chunk_length`` seconds before the STFT, so the last frames and the peak are those of the padded
    clip; the features are its first ceil(samples / hop) frames. Longer clips are refused."""

    min_length: int = 0
    chunk_length: int = 30
    transcription: str = "instruct"

    @classmethod
    def from_dir(cls, path: Path, audio_config: dict) -> WhisperAudioProcessor:
        try:
            pre = json.loads((path / "preprocessor_config.json").read_text())
        except FileNotFoundError:
            pre = {}
        return cls(
            num_mel_bins=int(pre.get("feature_size", audio_config.get("num_mel_bins", 128))),
            sampling_rate=int(pre.get("sampling_rate", SAMPLE_RATE)),
            n_fft=int(pre.get("n_fft", 400)),
            hop_length=int(pre.get("hop_length", 160)),
            n_window=int(audio_config.get("n_window", 100)),
            chunk_length=int(pre.get("chunk_length", 30)),
        )

    @property
    def max_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    def num_frames(self, num_samples: int) -> int:
        return -(-min(num_samples, self.max_samples) // self.hop_length)

    def audio_tokens(self, num_samples: int) -> int:
        frames = (self.num_frames(num_samples) - 1) // 2 + 1  # the stride-2 convolution
        return (frames - 2) // 2 + 1  # pooled by 2

    def features(self, samples: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(np.ascontiguousarray(samples, dtype=np.float32))
        if x.dim() != 1 or x.numel() == 0:
            raise ValueError("audio must be a non-empty 1D array of mono samples")
        if x.numel() > self.max_samples:
            raise ValueError(f"this model takes clips of at most {self.chunk_length} s")
        frames = self.num_frames(x.numel())
        return self._log_mel(torch.nn.functional.pad(x, (0, self.max_samples - x.numel())))[:frames]


def audio_processor(model_type: str, path: Path, audio_config: dict) -> AudioProcessor:
    """The front end of a model family with an audio encoder."""
    if model_type == "qwen2_5_omni":
        return WhisperAudioProcessor.from_dir(path, audio_config)
    processor = AudioProcessor.from_dir(path, audio_config)
    if model_type == "qwen3_omni_moe":  # Whisper's extractor without padding: Qwen3-ASR's, less the minimum
        return dataclasses.replace(processor, min_length=0, transcription="instruct")
    return processor


def conv_length(frames: int) -> int:
    """Tokens left of ``frames`` mel frames after three (kernel 3, stride 2, padding 1) convolutions."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames
