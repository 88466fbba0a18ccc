"""Qwen2.5-Omni's thinker, served with audio: its audio encoder and the Qwen2 text decoder.

The encoder reads a clip's log-mel frames (``runtime.multimodal.audio.WhisperAudioProcessor``) in
chunks of 2 x n_window frames: a width-3 convolution over time and a stride-2 one, each with GELU
(frames past the chunk's end zeroed in between), a sinusoidal position table restarted in every
chunk, transformer layers (LayerNorm first, biased attention, GELU MLP) attending within each chunk,
then each pair of rows averaged, a final LayerNorm and a projection to the text model's width: one
row per placeholder token.

The text decoder's rotary is M-RoPE, but text and audio tokens take equal positions on its three
axes, counting up, so for prompts of text and audio it is plain 1D rotary (images and videos, which
would take 3D positions, are not served: the vision tower is not loaded). The talker and the
vocoder of a full Omni checkpoint are not loaded either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import ACTIVATIONS, require
from trtedge.runtime.models.llama import LlamaModel
from trtedge.runtime.models.qwen2_5_vl import _Linear, _sub
from trtedge.runtime.models.qwen3_asr import AudioLayer, _LayerNorm, sinusoids


@dataclass(frozen=True)
class OmniAudioConfig:
    num_mel_bins: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    d_model: int
    output_dim: int
    n_window: int = 100
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @classmethod
    def from_hf(cls, cfg: dict) -> OmniAudioConfig:
        a = cfg.get("audio_config") or {}
        try:
            out = cls(
                num_mel_bins=int(a.get("num_mel_bins", 128)),
                encoder_layers=int(a["encoder_layers"]),
                encoder_attention_heads=int(a["encoder_attention_heads"]),
                encoder_ffn_dim=int(a["encoder_ffn_dim"]),
                d_model=int(a["d_model"]),
                output_dim=int(a["output_dim"]),
                n_window=int(a.get("n_window", 100)),
                max_source_positions=int(a.get("max_source_positions", 1500)),
                activation_function=str(a.get("activation_function", "gelu")),
            )
        except KeyError as e:
            raise ValueError(f"config.json audio_config: missing required field {e.args[0]!r}") from None
        if out.activation_function not in ACTIVATIONS:
            raise ValueError(f"config.json audio_config: unsupported activation {out.activation_function!r}")
        return out


class Qwen25OmniAudioEncoder:
    """Log-mel frames of a batch of clips -> one embedding per placeholder token, in clip order."""

    def __init__(self, cfg: OmniAudioConfig, tensors: dict[str, torch.Tensor], dtype, device):
        self.cfg = cfg
        self.dtype, self.device = dtype, device
        w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self.conv1 = (require(w, "conv1.weight"), w.get("conv1.bias"))
        self.conv2 = (require(w, "conv2.weight"), w.get("conv2.bias"))
        # layers in Whisper's layout, as Qwen3-ASR's (AudioLayer reads these names)
        self.layers = [AudioLayer(cfg, _sub(w, f"layers.{i}.")) for i in range(cfg.encoder_layers)]
        self.ln_post = _LayerNorm(w, "ln_post")
        self.proj = _Linear(w, "proj")
        self.positions = sinusoids(cfg.max_source_positions, cfg.d_model).to(device, dtype)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.conv1[0], self.conv2[0], self.proj.weight]
        tensors += [lin.weight for la in self.layers for lin in (la.q, la.k, la.v, la.out, la.fc1, la.fc2)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``features``: the clips' (frames, mel) rows one after another; ``grids``: (1, frames, mel)."""
        chunk = 2 * self.cfg.n_window
        clips = features.to(self.device, self.dtype).split([g[1] for g in grids])
        pieces = [piece for clip in clips for piece in clip.split(chunk)]
        lengths = torch.tensor([p.shape[0] for p in pieces])
        x = torch.stack([F.pad(p, (0, 0, 0, chunk - p.shape[0])) for p in pieces]).transpose(1, 2)
        mask = (torch.arange(chunk)[None, :] < lengths[:, None]).to(self.device, self.dtype)
        x = F.gelu(F.conv1d(x, *self.conv1, padding=1)) * mask[:, None, :]
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1)).transpose(1, 2)  # (chunks, T, d)
        x = x + self.positions[: x.shape[1]]
        after = (lengths - 1) // 2 + 1  # rows of each chunk after the stride-2 convolution
        keep = torch.arange(x.shape[1])[None, :] < after[:, None]
        x = x.reshape(-1, x.shape[-1])[keep.flatten().nonzero().squeeze(-1).to(self.device)]
        for layer in self.layers:
            x = layer(x, after.tolist())
        out = []
        for rows in x.split([_rows(clip, chunk) for clip in clips]):
            pairs = (rows.shape[0] - 2) // 2 + 1
            out.append((rows[0 : 2 * pairs : 2] + rows[1 : 2 * pairs : 2]) / 2)
        return self.proj(self.ln_post(torch.cat(out)))


def _rows(clip: torch.Tensor, chunk: int) -> int:
    """Rows a clip has after the stride-2 convolution, chunk by chunk."""
    return sum((piece.shape[0] - 1) // 2 + 1 for piece in clip.split(chunk))


class Qwen25OmniModel(LlamaModel):
    """The thinker's text decoder (qwen2) and, when the weights include it, its audio encoder as
    ``audio``."""

    def __init__(
        self, cfg, tensors: Iterable, dtype, device, weight_format: str = "float", max_positions: int = 8192
    ):
        audio: dict[str, torch.Tensor] = {}
        super().__init__(cfg, split_thinker(tensors, audio), dtype, device, weight_format, max_positions)
        self.vision = None
        self.audio = None
        if audio and cfg.audio is not None:
            self.audio = Qwen25OmniAudioEncoder(OmniAudioConfig.from_hf(cfg.audio), audio, dtype, device)


def split_thinker(tensors: Iterable, audio: dict, audio_prefix: str = ""):
    """The thinker's text tensors under the decoder's names; its audio tower's go into ``audio`` (their
    names after the tower's, behind ``audio_prefix``); the vision tower, the talker and the vocoder are
    left out."""
    for name, tensor in tensors:
        name = name.removeprefix("thinker.")
        for prefix in ("model.audio_tower.", "audio_tower."):
            if name.startswith(prefix):
                audio[audio_prefix + name[len(prefix) :]] = tensor
                break
        else:
            name = name.replace("model.language_model.", "model.", 1)
            if name.startswith(("model.", "lm_head.")) and not name.startswith("model.visual."):
                yield name, tensor
