"""The audio front end of RNN-T transcribers (Nemotron-3.5-ASR): NeMo's log-mel recipe and the
language prompt.

Features: a 0.97 pre-emphasis, a 512-point STFT of 400-sample symmetric Hann windows every 160
samples (centred, zero-padded), the power spectrum through Slaney mel filters up to half the sampling
rate, ``log(x + 2**-24)``, no normalisation; a clip of n samples keeps n // 160 frames. The encoder's
strided causal convolutions then leave one frame per 8 (``num_frames``). The language is a prompt
slot (``prompt_dictionary``: locales, bare codes and "auto") fused into every encoder frame.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trtedge.runtime.multimodal import MediaItem, MultimodalPrompt
from trtedge.runtime.multimodal.audio import SAMPLE_RATE, mel_filters

LOG_GUARD = 2.0**-24
ONLY_AUDIO = (
    "this model is an RNN-T transcriber: it takes one audio clip and nothing else, "
    '[{"role": "user", "content": [{"type": "audio", "audio": samples}]}] or LLM.audio.prompt(samples)'
)
AUTO = "auto"


@dataclass(frozen=True, eq=False)
class TransducerPrompt(MultimodalPrompt):
    """One clip for a transducer: ``ids`` are placeholders, one per encoder frame (the prompt's token
    count), ``items`` the clip's features; the language prompt slot and the attention lookahead."""

    prompt_id: int = 0
    lookahead: int = 0


@dataclass(frozen=True)
class TransducerAudioProcessor:
    num_mel_bins: int
    languages: dict[str, int]  # the checkpoint's prompt dictionary
    default_prompt_id: int
    lookahead: int  # right attention context, in encoder frames
    placeholder_id: int  # the blank token: the prompt ids are only counted
    sampling_rate: int = SAMPLE_RATE
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    preemphasis: float = 0.97
    window_dtype: str = "float32"  # some checkpoints keep the window and filters rounded to bf16
    num_stages: int = 3  # strided convolutions of the encoder (log2 of the subsampling factor)
    stride: int = 2
    max_frames: int = 5000  # encoder frames the relative positions cover (max_position_embeddings)
    transcription: str = "transducer"  # how a transcription is asked for (server: the route's branch)
    filters: torch.Tensor = field(init=False, repr=False, compare=False)
    window: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_mel_bins", "sampling_rate", "n_fft", "win_length", "hop_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"processor_config.json: {name} must be a positive integer, got {value!r}")
        if self.window_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"processor_config.json: mel_filters_dtype {self.window_dtype!r} is not supported"
            )
        rounding = getattr(torch, self.window_dtype)
        fb = mel_filters(
            1 + self.n_fft // 2, self.num_mel_bins, self.sampling_rate, 0.0, self.sampling_rate / 2
        )
        fb = torch.from_numpy(fb).to(torch.float32).T.contiguous()
        object.__setattr__(self, "filters", fb.to(rounding).float())
        window = torch.hann_window(self.win_length, periodic=False).to(rounding).float()
        object.__setattr__(self, "window", window)

    @classmethod
    def from_dir(cls, path: Path, top: dict, encoder: dict) -> TransducerAudioProcessor:
        """From processor_config.json (its feature_extractor section) or preprocessor_config.json, the
        encoder's config (``encoder``) and the model's (``top``) for what they leave out."""
        proc = _read_json(path / "processor_config.json")
        pre = _read_json(path / "preprocessor_config.json") or proc.get("feature_extractor") or {}
        prompts = "num_prompts" in top  # Nemotron-3.5-ASR; nemotron_asr_streaming has no language prompt
        languages = (proc.get("prompt_dictionary") or DEFAULT_LANGUAGES) if prompts else {}
        lookahead = proc.get("default_num_lookahead_tokens", encoder.get("default_num_lookahead_tokens", 13))
        return cls(
            num_mel_bins=int(pre.get("feature_size", encoder.get("num_mel_bins", 128))),
            languages={str(k): int(v) for k, v in languages.items()},
            default_prompt_id=int(top.get("default_prompt_id", languages.get(AUTO, 101 if prompts else 0))),
            lookahead=int(lookahead),
            placeholder_id=int(top.get("blank_token_id", int(top.get("vocab_size", 13088)) - 1)),
            sampling_rate=int(pre.get("sampling_rate", SAMPLE_RATE)),
            n_fft=int(pre.get("n_fft", 512)),
            win_length=int(pre.get("win_length", 400)),
            hop_length=int(pre.get("hop_length", 160)),
            preemphasis=float(pre.get("preemphasis") or 0.0),
            window_dtype=str(pre.get("mel_filters_dtype", "float32")),
            num_stages=int(math.log2(int(encoder.get("subsampling_factor", 8)))),
            stride=int(encoder.get("subsampling_conv_stride", 2)),
            max_frames=int(encoder.get("max_position_embeddings", 5000)),
        )

    def num_frames(self, num_samples: int) -> int:
        """Encoder frames (prompt tokens) of a clip of ``num_samples`` samples."""
        n = num_samples // self.hop_length
        for _ in range(self.num_stages):
            n = (n + self.stride - 2) // self.stride + 1
        return n

    audio_tokens = num_frames

    def features(self, samples: np.ndarray) -> torch.Tensor:
        """(frames, num_mel_bins) float32 log-mel features of a mono clip."""
        x = torch.as_tensor(np.ascontiguousarray(samples, dtype=np.float32))
        if x.dim() != 1 or x.numel() == 0:
            raise ValueError("audio must be a non-empty 1D array of mono samples")
        frames = x.numel() // self.hop_length
        if frames == 0:
            raise ValueError(
                f"the clip is shorter than one {1000 * self.hop_length // self.sampling_rate} ms frame"
            )
        if self.preemphasis:
            x = torch.cat([x[:1], x[1:] - self.preemphasis * x[:-1]])
        stft = torch.stft(
            x,
            self.n_fft,
            hop_length=self.hop_length,
            win_length=self.win_length,
            window=self.window,
            center=True,
            pad_mode="constant",
            return_complex=True,
        )
        power = torch.view_as_real(stft).pow(2).sum(-1)
        mel = torch.log(self.filters @ power + LOG_GUARD)
        return mel[:, :frames].T.contiguous()

    def audio(self, samples: np.ndarray, offset: int = 0) -> MediaItem:
        feats = self.features(samples)
        digest = hashlib.blake2b(feats.numpy().tobytes(), digest_size=16).digest()
        tokens = self.num_frames(int(np.asarray(samples).shape[0]))
        return MediaItem("audio", feats, (1, feats.shape[0], feats.shape[1]), digest, offset, tokens)

    def prompt_id(self, language: str | None) -> int:
        """The prompt slot of ``language`` (a locale such as "en-US", a bare code such as "de", or
        "auto"; None: the model's default); ValueError naming the codes it knows otherwise."""
        if language is None:
            return self.default_prompt_id
        if not self.languages:
            raise ValueError(
                "this model has no language prompt (it transcribes one language); leave language out"
            )
        if language in self.languages:
            return self.languages[language]
        folded = {k.lower(): v for k, v in self.languages.items()}
        if language.strip().lower() in folded:
            return folded[language.strip().lower()]
        codes = sorted(k for k in self.languages if "-" not in k)
        raise ValueError(
            f"language {language!r} is not one the model transcribes; send a code such as "
            f"{', '.join(codes)}, a locale such as en-US, or auto"
        )

    def from_messages(self, messages) -> TransducerPrompt:
        """The request of a chat holding one audio part (``{"type": "audio", "audio": samples}``, an
        optional ``"language"`` beside it) and nothing else to hear; ValueError otherwise."""
        parts = []
        for m in messages if isinstance(messages, list) else ():
            content = m.get("content") if isinstance(m, dict) else None
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "audio":
                    parts.append(part)
                elif not (isinstance(part, dict) and part.get("type") == "text" and not part.get("text")):
                    raise ValueError(ONLY_AUDIO)
            if isinstance(content, str) and content:
                raise ValueError(ONLY_AUDIO)
        if len(parts) != 1:
            raise ValueError(ONLY_AUDIO)
        samples = parts[0].get("audio")
        if not isinstance(samples, np.ndarray):
            raise ValueError("'audio' must be a 1D numpy array of mono samples")
        return self.prompt(samples, parts[0].get("language"))

    def prompt(self, samples: np.ndarray, language: str | None = None) -> TransducerPrompt:
        """The request for one clip (``language``: see ``prompt_id``)."""
        prompt_id = self.prompt_id(language)
        frames = self.num_frames(int(np.asarray(samples).shape[0]))
        if frames > self.max_frames:
            seconds = (self.max_frames << self.num_stages) * self.hop_length // self.sampling_rate
            raise ValueError(
                f"the clip is {frames} encoder frames; this model takes at most {self.max_frames} (about {seconds} s)"
            )
        item = self.audio(samples)
        ids = [self.placeholder_id] * item.num_tokens
        return TransducerPrompt(ids, (item,), None, prompt_id=prompt_id, lookahead=self.lookahead)


def transducer_audio_processor(path: Path, cfg) -> TransducerAudioProcessor:
    """The front end of a transducer checkpoint at ``path`` (``cfg``: its ModelConfig)."""
    return TransducerAudioProcessor.from_dir(path, cfg.text_config, cfg.audio["audio_config"])


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


# NeMo's prompt dictionary of Nemotron-3.5-ASR, for a checkpoint whose processor_config.json has none.
DEFAULT_LANGUAGES = {
    "en-US": 0, "en": 0, "en-GB": 1, "es-ES": 2, "es-US": 3, "es": 3, "zh-CN": 4, "zh-TW": 5,
    "hi-IN": 6, "hi": 6, "ar-AR": 7, "ar": 7, "fr-FR": 8, "fr": 8, "de-DE": 9, "de": 9,
    "ja-JP": 10, "ru-RU": 11, "ru": 11, "pt-BR": 12, "pt-PT": 13, "pt": 13, "ko-KR": 14, "ko": 14,
    "it-IT": 15, "it": 15, "nl-NL": 16, "nl": 16, "pl-PL": 17, "pl": 17, "tr-TR": 18, "tr": 18,
    "uk-UA": 19, "uk": 19, "ro-RO": 20, "ro": 20, "el-GR": 21, "el": 21, "cs-CZ": 22, "cs": 22,
    "hu-HU": 23, "hu": 23, "sv-SE": 24, "sv": 24, "da-DK": 25, "da": 25, "fi-FI": 26, "fi": 26,
    "no-NO": 27, "no": 27, "sk-SK": 28, "sk": 28, "hr-HR": 29, "hr": 29, "bg-BG": 30, "bg": 30,
    "lt-LT": 31, "lt": 31, "th-TH": 32, "vi-VN": 33, "id-ID": 34, "ms-MY": 35, "et-EE": 60, "et": 60,
    "lv-LV": 61, "lv": 61, "sl-SI": 62, "sl": 62, "he-IL": 64, "fr-CA": 100, "auto": 101, "mt-MT": 102,
    "nb-NO": 103, "nb": 103, "nn-NO": 104, "nn": 104,
}  # fmt: skip
