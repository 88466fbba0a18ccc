"""Qwen3-ASR: its audio encoder (a Whisper-style transformer behind a convolutional downsampler) and
projector, and the model that pairs them with the Qwen3 text decoder (plain 1D rotary). Qwen3-Omni's
thinker has the same encoder (its projector inside the tower) before a Qwen3-MoE decoder.

The encoder reads each clip's log-mel frames (``runtime.multimodal.audio``) in chunks of
2 x n_window frames (the last one zero-padded): three 3x3 stride-2 convolutions with GELU over
(mel, time), a linear layer over channels x remaining mel bins, plus a sinusoidal position table
restarted in every chunk; only the rows a chunk's real frames reach are kept. Transformer layers
(LayerNorm first, biased attention, GELU MLP) attend within windows of n_window_infer frames'
worth of tokens, then a final LayerNorm and the projector (linear, GELU, linear) to the text
model's width: one row per placeholder token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import ACTIVATIONS, rename_prefix, require
from trtedge.runtime.models.llama import LlamaModel
from trtedge.runtime.models.moe import MoeModel
from trtedge.runtime.models.qwen2_5_vl import _Linear, _sub, segment_attention
from trtedge.runtime.multimodal.audio import conv_length

AUDIO_PREFIXES = (
    "model.audio_tower.",
    "audio_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.": ""}


def is_audio_tensor(name: str) -> bool:
    return name.startswith(AUDIO_PREFIXES)


@dataclass(frozen=True)
class AudioConfig:
    num_mel_bins: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    d_model: int
    output_dim: int
    downsample_hidden_size: int
    n_window: int = 50
    n_window_infer: int = 800
    max_position_embeddings: int = 13
    activation_function: str = "gelu"
    scale_embedding: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> AudioConfig:
        """From the model's config.json (its ``audio_config``)."""
        a = cfg.get("audio_config") or {}
        try:
            out = cls(
                num_mel_bins=int(a.get("num_mel_bins", 128)),
                encoder_layers=int(a["encoder_layers"]),
                encoder_attention_heads=int(a["encoder_attention_heads"]),
                encoder_ffn_dim=int(a["encoder_ffn_dim"]),
                d_model=int(a["d_model"]),
                output_dim=int(a["output_dim"]),
                downsample_hidden_size=int(a.get("downsample_hidden_size", 480)),
                n_window=int(a.get("n_window", 50)),
                n_window_infer=int(a.get("n_window_infer", 800)),
                max_position_embeddings=int(a.get("max_position_embeddings", 13)),
                activation_function=str(a.get("activation_function", "gelu")),
                scale_embedding=bool(a.get("scale_embedding", False)),
            )
        except KeyError as e:
            raise ValueError(f"config.json audio_config: missing required field {e.args[0]!r}") from None
        if out.n_window_infer % (2 * out.n_window):
            raise ValueError("config.json audio_config: n_window_infer must be a multiple of 2 x n_window")
        if out.activation_function not in ACTIVATIONS:
            raise ValueError(f"config.json audio_config: unsupported activation {out.activation_function!r}")
        return out

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table: sin then cos of log-spaced timescales, (length, channels)."""
    step = np.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class _LayerNorm:
    def __init__(self, w: dict, name: str):
        self.weight, self.bias = require(w, name + ".weight"), w.get(name + ".bias")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class AudioLayer:
    def __init__(self, cfg: AudioConfig, w: dict):
        self.cfg = cfg
        self.norm1, self.norm2 = _LayerNorm(w, "self_attn_layer_norm"), _LayerNorm(w, "final_layer_norm")
        self.q, self.k, self.v = (_Linear(w, f"self_attn.{n}_proj") for n in "qkv")
        self.out = _Linear(w, "self_attn.out_proj")
        self.fc1, self.fc2 = _Linear(w, "fc1"), _Linear(w, "fc2")
        self.act = ACTIVATIONS[cfg.activation_function]

    def __call__(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        n, heads = x.shape[0], self.cfg.encoder_attention_heads
        h = self.norm1(x)
        q, k, v = (proj(h).view(n, heads, -1) for proj in (self.q, self.k, self.v))
        x = x + self.out(segment_attention(q, k, v, windows).reshape(n, -1))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Qwen3ASRAudioEncoder:
    """Log-mel frames of a batch of clips -> one embedding per placeholder token, in clip order."""

    def __init__(
        self, cfg: AudioConfig, tensors: dict[str, torch.Tensor], dtype, device, pad_short_clips: bool = True
    ):
        self.cfg = cfg
        self.dtype, self.device = dtype, device
        self.pad_short_clips = pad_short_clips
        w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        tower = _sub(w, "audio_tower.")
        self.convs = [(require(tower, f"conv2d{i}.weight"), tower.get(f"conv2d{i}.bias")) for i in (1, 2, 3)]
        self.conv_out = require(tower, "conv_out.weight")
        self.layers = [AudioLayer(cfg, _sub(tower, f"layers.{i}.")) for i in range(cfg.encoder_layers)]
        self.ln_post = _LayerNorm(tower, "ln_post")
        if "multi_modal_projector.linear_1.weight" in w:  # Qwen3-ASR: the projector beside the tower
            proj = _sub(w, "multi_modal_projector.")
            self.proj1, self.proj2 = _Linear(proj, "linear_1"), _Linear(proj, "linear_2")
        else:  # Qwen3-Omni: inside it
            self.proj1, self.proj2 = _Linear(tower, "proj1"), _Linear(tower, "proj2")
        self.act = ACTIVATIONS[cfg.activation_function]
        self.positions = sinusoids(cfg.max_position_embeddings, cfg.d_model).to(device, dtype)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.conv_out, self.proj1.weight, self.proj2.weight] + [c[0] for c in self.convs]
        tensors += [lin.weight for la in self.layers for lin in (la.q, la.k, la.v, la.out, la.fc1, la.fc2)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _embed(self, chunks: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(chunks, mel, width) -> the rows the chunks' real frames reach, positions added."""
        x = chunks.unsqueeze(1)
        for weight, bias in self.convs:
            x = F.gelu(F.conv2d(x, weight, bias, stride=2, padding=1))
        n, c, f, t = x.shape
        x = F.linear(x.permute(0, 3, 1, 2).reshape(n, t, c * f), self.conv_out) + self.positions[:t]
        keep = torch.arange(t)[None, :] < torch.tensor([conv_length(k) for k in lengths])[:, None]
        return x.reshape(n * t, -1)[keep.flatten().nonzero().squeeze(-1).to(self.device)]

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``features``: the clips' (frames, mel) rows one after another; ``grids``: (1, frames, mel)."""
        cfg = self.cfg
        chunk = 2 * cfg.n_window
        per_window = conv_length(chunk) * (cfg.n_window_infer // chunk)
        rows, windows = [], []
        for clip in features.to(self.device, self.dtype).split([g[1] for g in grids]):
            frames = clip.shape[0]
            # Qwen3-ASR's extractor pads every clip to whole chunks; Qwen3-Omni's leaves a clip shorter
            # than one chunk as it is (the convolutions' padding then differs past its end)
            width = chunk if self.pad_short_clips or frames >= chunk else frames
            padded = F.pad(clip, (0, 0, 0, -frames % width))  # (chunks * width, mel)
            lengths = [min(width, frames - i) for i in range(0, frames, width)]
            rows.append(self._embed(padded.view(-1, width, clip.shape[1]).transpose(1, 2), lengths))
            tokens = sum(conv_length(n) for n in lengths)
            windows += [per_window] * (tokens // per_window) + (
                [tokens % per_window] if tokens % per_window else []
            )
        x = torch.cat(rows)
        for layer in self.layers:
            x = layer(x, windows)
        x = self.ln_post(x)
        return self.proj2(self.act(self.proj1(x)))


class Qwen3OmniModel(MoeModel):
    """Qwen3-Omni's thinker, served with audio: the Qwen3-MoE text decoder (text and audio take equal
    M-RoPE positions on its three axes, so it runs as 1D rotary) and, when the weights include it, the
    audio encoder as ``audio``; the vision tower, talker and vocoder are not loaded."""

    def __init__(
        self, cfg, tensors: Iterable, dtype, device, weight_format: str = "float", max_positions: int = 8192
    ):
        from trtedge.runtime.models.qwen2_5_omni import split_thinker

        audio: dict[str, torch.Tensor] = {}
        thinker = split_thinker(tensors, audio, "audio_tower.")
        super().__init__(cfg, thinker, dtype, device, weight_format, max_positions)
        self.vision = None
        self.audio = None
        if audio and cfg.audio is not None:
            config = AudioConfig.from_hf(cfg.audio)
            self.audio = Qwen3ASRAudioEncoder(config, audio, dtype, device, pad_short_clips=False)


class Qwen3ASRModel(LlamaModel):
    """The Qwen3-ASR text decoder (qwen3) and, when the weights include it, its audio encoder as
    ``audio`` (None for a text-only load)."""

    def __init__(
        self, cfg, tensors: Iterable, dtype, device, weight_format: str = "float", max_positions: int = 8192
    ):
        audio: dict[str, torch.Tensor] = {}
        super().__init__(cfg, split_audio(tensors, audio), dtype, device, weight_format, max_positions)
        self.vision = None
        self.audio = None
        if audio and cfg.audio is not None:
            self.audio = Qwen3ASRAudioEncoder(AudioConfig.from_hf(cfg.audio), audio, dtype, device)


def split_audio(tensors: Iterable, audio: dict):
    """The text model's tensors under the decoder's names; the audio encoder's and projector's go into
    ``audio`` (as ``audio_tower.*`` / ``multi_modal_projector.*``)."""
    for name, tensor in tensors:
        if is_audio_tensor(name):
            audio[name.removeprefix("model.")] = tensor
        else:
            yield rename_prefix(name, _TEXT_PREFIXES), tensor
