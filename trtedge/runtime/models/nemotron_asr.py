"""Nemotron-3.5-ASR (``nemotron3_5_asr``) and its English-only predecessor (``nemotron_asr_streaming``,
no language prompt): RNN-T transcribers.

A FastConformer encoder (causal depthwise-separable 8x subsampling, Transformer-XL relative attention
under a ``chunked_limited`` mask, causal convolution modules), the language prompt fused into every
encoder frame, and a transducer head: an LSTM prediction network fed the last emitted token and a
joint network scoring (frame, prediction) pairs. Greedy decoding walks the frames: a blank moves to
the next frame, any other token is emitted and fed back, and ``max_symbols_per_step`` emissions on one
frame force a move. No KV cache and no engine scheduler: ``runtime.transducer`` runs whole clips.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.models.config import ModelConfig

_ACTS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu}


def _activation(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(f"config.json: activation {name!r} is not supported ({', '.join(_ACTS)})") from None


class _Block:
    """One conformer block: half-step feed-forward, relative attention, convolution, feed-forward."""

    def __init__(self, w: dict[str, torch.Tensor], heads: int, act):
        self.w, self.heads, self.act = w, heads, act

    @property
    def linears(self) -> list:
        return []

    def _norm(self, x, name):
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"])

    def _linear(self, x, name, bias=True):
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias") if bias else None)

    def _ff(self, x, name):
        return self._linear(self.act(self._linear(x, name + ".linear1")), name + ".linear2")

    def __call__(self, x, pos, mask):
        x = x + 0.5 * self._ff(self._norm(x, "norm_feed_forward1"), "feed_forward1")
        x = x + self._attention(self._norm(x, "norm_self_att"), pos, mask)
        x = x + self._conv(self._norm(x, "norm_conv"))
        x = x + 0.5 * self._ff(self._norm(x, "norm_feed_forward2"), "feed_forward2")
        return self._norm(x, "norm_out")

    def _attention(self, x, pos, mask):
        n, h = x.shape[0], self.heads
        d = x.shape[1] // h
        q, k, v = (self._linear(x, f"self_attn.{p}_proj").view(n, h, d).transpose(0, 1) for p in "qkv")
        rel = self._linear(pos, "self_attn.relative_k_proj", bias=False).view(-1, h, d).permute(1, 2, 0)
        scale = d**-0.5
        bd = (q + self.w["self_attn.bias_v"][:, None]) @ rel  # (h, n, 2n - 1)
        bd = _rel_shift(bd)[..., :n] * scale
        bd = bd.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q + self.w["self_attn.bias_u"][:, None], k, v, bd, scale=scale)
        return self._linear(out.transpose(0, 1).reshape(n, h * d), "self_attn.o_proj")

    def _conv(self, x):
        w = self.w
        y = F.conv1d(x.T[None], w["conv.pointwise_conv1.weight"], w.get("conv.pointwise_conv1.bias"))
        y = F.glu(y, dim=1)
        kernel = w["conv.depthwise_conv.weight"]
        y = F.pad(y, (kernel.shape[-1] - 1, 0))  # causal
        y = F.conv1d(y, kernel, w.get("conv.depthwise_conv.bias"), groups=kernel.shape[0])
        y = self._norm(y[0].T, "conv.norm")
        y = F.conv1d(
            self.act(y).T[None], w["conv.pointwise_conv2.weight"], w.get("conv.pointwise_conv2.bias")
        )
        return y[0].T


def _rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """Transformer-XL's shift: row i of (h, n, 2n - 1) relative scores starts at distance n - 1 - i."""
    h, n, p = scores.shape
    return F.pad(scores, (1, 0)).view(h, -1, n)[:, 1:].reshape(h, n, p)


def chunked_limited_mask(n: int, left: int, right: int, device) -> torch.Tensor:
    """(n, n) bool: frame q sees the frames of its own chunk (``right`` + 1 frames) and of the
    ``left // (right + 1)`` chunks before it, as the model was trained for streaming."""
    chunk = right + 1
    idx = torch.arange(n, device=device) // chunk
    diff = idx[:, None] - idx[None, :]
    return (diff >= 0) & (diff <= left // chunk)


class NemotronASRModel:
    """Weights in HF names; ``encode`` turns log-mel frames into joint-space frames, ``greedy`` yields
    the tokens of those frames (blanks dropped)."""

    def __init__(
        self, cfg: ModelConfig, tensors, dtype, device, own_format: str = "float", max_positions: int = 0
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        top = cfg.text_config
        enc = cfg.audio["audio_config"]
        self.blank = int(top.get("blank_token_id", cfg.vocab_size - 1))
        self.max_symbols = int(top.get("max_symbols_per_step", 10))
        self.num_prompts = int(top.get("num_prompts", 128))
        self.default_prompt = int(top.get("default_prompt_id", 101))
        self.start_token = int(top.get("decoder_start_token_id", self.blank))
        self.subsampling_factor = int(enc.get("subsampling_factor", 8))
        self.stride = int(enc.get("subsampling_conv_stride", 2))
        self.heads = int(enc.get("num_attention_heads", 8))
        self.left_context = int(enc.get("sliding_window", 71)) - 1
        self.lookahead = int(enc.get("default_num_lookahead_tokens", 13))
        self.max_frames = int(enc.get("max_position_embeddings", 5000))
        self.input_scale = math.sqrt(int(enc["hidden_size"])) if enc.get("scale_input", True) else 1.0
        self.act = _activation(str(enc.get("hidden_act", "silu")))
        self.joint_act = _activation(str(top.get("hidden_act", "relu")))
        w: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            if isinstance(t, QuantizedTensor):
                t = t.dequantize(torch.float32)
            w[name] = t
        decoder = {k: w.pop(k) for k in [k for k in w if k.startswith(("decoder.", "joint."))]}
        self.w = {k: v.to(device=self.device, dtype=dtype) for k, v in w.items()}
        # the prediction network and the joint stay in float32: small, and run once per emitted symbol
        self.dw = {k: v.to(device=self.device, dtype=torch.float32) for k, v in decoder.items()}
        num_layers = int(enc["num_hidden_layers"])
        self.layers = [
            _Block(_sub(self.w, f"encoder.layers.{i}."), self.heads, self.act) for i in range(num_layers)
        ]
        self.num_stages = int(math.log2(self.subsampling_factor))
        self.lstm = self._lstm(int(top.get("num_decoder_layers", 2)))
        hidden = int(enc["hidden_size"])
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hidden, 2, dtype=torch.float32) / hidden))
        self.has_prompt = "prompt_projector.linear_1.weight" in self.w
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (*self.w.values(), *self.dw.values()))

    def _lstm(self, num_layers: int) -> torch.nn.LSTM:
        emb = self.dw["decoder.embedding.weight"]
        lstm = torch.nn.LSTM(emb.shape[1], emb.shape[1], num_layers=num_layers, batch_first=True)
        state = {
            k.removeprefix("decoder.lstm."): v for k, v in self.dw.items() if k.startswith("decoder.lstm.")
        }
        lstm.load_state_dict(state)
        return lstm.to(self.device).eval()

    def num_frames(self, num_mel_frames: int) -> int:
        """Encoder frames of a clip of ``num_mel_frames`` (each stage: a strided causal conv)."""
        n = num_mel_frames
        for _ in range(self.num_stages):
            n = (n + self.stride - 2) // self.stride + 1
        return n

    @torch.inference_mode()
    def encode(
        self, features: torch.Tensor, prompt_id: int | None = None, lookahead: int | None = None
    ) -> torch.Tensor:
        """(encoder frames, joint hidden) float32 for (mel frames, mel bins) features; ``prompt_id``: the
        language slot (default: the config's), ``lookahead``: the right attention context in frames."""
        w = self.w
        x = features.to(device=self.device, dtype=self.dtype)[None, None]
        x = F.relu(self._causal_conv2d(x, "encoder.subsampling.conv_in", groups=1))
        for i in range(self.num_stages - 1):
            p = f"encoder.subsampling.layers.{i}."
            x = self._causal_conv2d(x, p + "depthwise_conv", groups=x.shape[1])
            x = F.relu(F.conv2d(x, w[p + "pointwise_conv.weight"], w[p + "pointwise_conv.bias"]))
        x = x[0].transpose(0, 1).reshape(x.shape[2], -1)
        x = F.linear(x, w["encoder.subsampling.linear.weight"], w["encoder.subsampling.linear.bias"])
        x = x * self.input_scale
        n = x.shape[0]
        pos = self._positions(n).to(x.dtype)
        right = self.lookahead if lookahead is None else lookahead
        mask = chunked_limited_mask(n, self.left_context, right, self.device)
        for layer in self.layers:
            x = layer(x, pos, mask)
        if self.has_prompt:  # Nemotron-3.5-ASR: the language slot, one-hot, fused into every frame
            prompt = self.default_prompt if prompt_id is None else prompt_id
            one_hot = torch.zeros(n, self.num_prompts, dtype=x.dtype, device=self.device)
            one_hot[:, prompt] = 1
            x = F.linear(
                torch.cat([x, one_hot], -1),
                w["prompt_projector.linear_1.weight"],
                w["prompt_projector.linear_1.bias"],
            )
            x = F.linear(
                F.relu(x), w["prompt_projector.linear_2.weight"], w["prompt_projector.linear_2.bias"]
            )
        x = F.linear(x, w["encoder_projector.weight"], w["encoder_projector.bias"])
        return x.float()

    def _causal_conv2d(self, x, name: str, groups: int):
        weight = self.w[name + ".weight"]
        k, s = weight.shape[-1], self.stride
        # time, as frequency: (kernel - 1) frames before, (stride - 1) after: causal
        x = F.pad(x, (k - 1, s - 1, k - 1, s - 1))
        return F.conv2d(x, weight, self.w[name + ".bias"], stride=s, groups=groups)

    def _positions(self, n: int) -> torch.Tensor:
        if n > self.max_frames:
            raise ValueError(f"the clip has {n} encoder frames, more than the model's {self.max_frames}")
        distance = torch.arange(n - 1, -n, -1, dtype=torch.float32)
        freqs = distance[:, None] * self.inv_freq
        return torch.stack([freqs.sin(), freqs.cos()], -1).reshape(2 * n - 1, -1).to(self.device)

    @torch.inference_mode()
    def greedy(self, frames: torch.Tensor) -> Iterator[int]:
        """The transcript's token ids, as greedy RNN-T decoding finds them, frame by frame."""
        dw = self.dw
        head_w, head_b = dw["joint.head.weight"], dw["joint.head.bias"]
        pred, state = self._predict(self.start_token, None)
        t, emitted = 0, 0
        while t < frames.shape[0]:
            token = int(F.linear(self.joint_act(frames[t] + pred), head_w, head_b).argmax())
            if token == self.blank:
                t, emitted = t + 1, 0
                continue
            yield token
            pred, state = self._predict(token, state)
            emitted += 1
            if emitted >= self.max_symbols:
                t, emitted = t + 1, 0

    def _predict(self, token: int, state):
        emb = self.dw["decoder.embedding.weight"][token].view(1, 1, -1)
        out, state = self.lstm(emb, state)
        out = F.linear(
            out[0, 0], self.dw["decoder.decoder_projector.weight"], self.dw["decoder.decoder_projector.bias"]
        )
        return out, state


def _sub(w: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in w.items() if k.startswith(prefix)}
