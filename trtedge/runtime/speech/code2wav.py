"""Qwen3-Omni's Code2Wav: codec frames (``num_quantizers`` codes each, 12.5 per second) -> a 24 kHz
mono waveform in [-1, 1]. The codes' embeddings are averaged, run through a sliding-window transformer,
upsampled by causal transposed convolutions with ConvNeXt blocks, then by a causal convolution decoder
with SnakeBeta activations and dilated residual units.

Decoding goes chunk by chunk (``chunked``): each chunk is decoded with up to ``left_context`` frames
before it, so that audio streams while the Talker still speaks. The transposed convolutions leave the
last ``tail`` samples of a decode out (they would need the frames after it); a chunk decoded after
context starts where the previous chunk stopped, ``tail`` samples before its own first frame, so the
chunks concatenate to the waveform of the whole (the reference's chunked decode drops those samples,
a gap at every chunk's boundary)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import require
from trtedge.runtime.speech.config import SpeechConfig
from trtedge.runtime.speech.layers import Decoder, sub

LEFT_CONTEXT = 25


class CausalConv:
    def __init__(self, w: dict, name: str, dilation: int = 1, stride: int = 1, groups: int = 1):
        self.weight, self.bias = require(w, name + ".conv.weight"), w.get(name + ".conv.bias")
        self.dilation, self.stride, self.groups = dilation, stride, groups
        self.kernel = (self.weight.shape[-1] - 1) * dilation + 1
        self.padding = self.kernel - stride

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = (length - self.kernel + self.padding) / self.stride + 1
        extra = (math.ceil(frames) - 1) * self.stride + (self.kernel - self.padding) - length
        x = F.pad(x, (self.padding, extra))
        return F.conv1d(x, self.weight, self.bias, self.stride, dilation=self.dilation, groups=self.groups)


class CausalTransConv:
    def __init__(self, w: dict, name: str, stride: int):
        self.weight, self.bias = require(w, name + ".conv.weight"), w.get(name + ".conv.bias")
        self.stride = stride
        self.trim = self.weight.shape[-1] - stride

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = F.conv_transpose1d(x, self.weight, self.bias, self.stride)
        return x[..., self.trim : x.shape[-1] - self.trim]


class Snake:
    """SnakeBeta: x + sin^2(x e^alpha) / (e^beta + 1e-9), per channel."""

    def __init__(self, w: dict, name: str):
        self.alpha = torch.exp(require(w, name + ".alpha"))[None, :, None]
        self.beta = torch.exp(require(w, name + ".beta"))[None, :, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + (1.0 / (self.beta + 1e-9)) * torch.sin(x * self.alpha) ** 2


class ConvNeXt:
    def __init__(self, w: dict, dim: int):
        self.dwconv = CausalConv(w, "dwconv", groups=dim)
        self.norm = (require(w, "norm.weight"), w.get("norm.bias"))
        self.fc1 = (require(w, "pwconv1.weight"), w.get("pwconv1.bias"))
        self.fc2 = (require(w, "pwconv2.weight"), w.get("pwconv2.bias"))
        self.gamma = require(w, "gamma")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = F.layer_norm(h, self.norm[0].shape, *self.norm, eps=1e-6)
        h = F.linear(F.gelu(F.linear(h, *self.fc1)), *self.fc2)
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit:
    def __init__(self, w: dict, dilation: int):
        self.act1, self.act2 = Snake(w, "act1"), Snake(w, "act2")
        self.conv1, self.conv2 = CausalConv(w, "conv1", dilation=dilation), CausalConv(w, "conv2")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class Code2Wav:
    def __init__(self, cfg: SpeechConfig, tensors: dict[str, torch.Tensor], dtype, device):
        """``tensors``: the checkpoint's ``code2wav.*`` tensors, names without the prefix."""
        self.cfg = cfg
        self.dtype, self.device = dtype, device
        w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self.transformer = Decoder(
            cfg.code2wav, sub(w, "pre_transformer."), device, qk_norm=False, layer_scale=True
        )
        self.embedding = require(w, "code_embedding.weight")
        self.offsets = torch.arange(cfg.num_code_groups, device=device) * cfg.codebook_size
        dim = cfg.code2wav.hidden_size
        self.upsample = [
            (CausalTransConv(w, f"upsample.{i}.0", r), ConvNeXt(sub(w, f"upsample.{i}.1."), dim))
            for i, r in enumerate(cfg.upsampling_ratios)
        ]
        self.decoder: list = [CausalConv(w, "decoder.0")]
        for i, rate in enumerate(cfg.upsample_rates):
            b = sub(w, f"decoder.{i + 1}.block.")
            self.decoder.append(Snake(b, "0"))
            self.decoder.append(CausalTransConv(b, "1", rate))
            self.decoder += [ResidualUnit(sub(b, f"{2 + j}."), d) for j, d in enumerate((1, 3, 9))]
        last = len(cfg.upsample_rates) + 1
        self.decoder += [Snake(w, f"decoder.{last}"), CausalConv(w, f"decoder.{last + 1}")]
        # a decode of n frames is n * samples_per_frame - tail samples (the convolutions keep lengths)
        self.tail = 0
        for layer in [t for t, _ in self.upsample] + self.decoder:
            if isinstance(layer, CausalTransConv):
                self.tail = self.tail * layer.stride + layer.trim

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """(frames, num_quantizers) codes -> (frames * samples_per_frame - tail,) float32 waveform
        clamped to [-1, 1]."""
        codes = codes.to(self.device)
        hidden = self.embedding[codes + self.offsets].mean(1)
        x = self.transformer(hidden).T[None]  # (1, channels, frames)
        for trans, block in self.upsample:
            x = block(trans(x))
        for layer in self.decoder:
            x = layer(x)
        return x.clamp(-1, 1)[0, 0].float()

    def chunked(
        self, frames: Iterable[list[int]], chunk_frames: int, left_context: int = LEFT_CONTEXT
    ) -> Iterator[torch.Tensor]:
        """The waveform of ``frames`` as it can be made: one piece per ``chunk_frames`` frames (the
        last may be shorter), each decoded with up to ``left_context`` frames before it; the pieces
        concatenate to the whole's waveform (``frames * samples_per_frame - tail`` samples)."""
        done: list[list[int]] = []
        start = 0
        pending = 0
        for frame in frames:
            done.append(frame)
            pending += 1
            if pending == chunk_frames:
                yield self.chunk(done, start, left_context)
                start, pending = len(done), 0
        if pending:
            yield self.chunk(done, start, left_context)

    def chunk(self, done: list[list[int]], start: int, left_context: int = LEFT_CONTEXT) -> torch.Tensor:
        """The piece of frames ``done[start:]``, decoded after up to ``left_context`` frames before."""
        context = min(left_context, start)
        codes = torch.tensor(done[start - context :], dtype=torch.long)
        # after context, from where the previous piece stopped: its last ``tail`` samples are here
        skip = context * self.cfg.samples_per_frame - (self.tail if context else 0)
        return self(codes)[skip:]
