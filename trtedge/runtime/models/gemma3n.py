"""Gemma 3n (text): the Gemma 4 decoder (``PleModel``: per-layer embeddings, q/k/v norms, KV sharing)
with

- AltUp: the residual stream is ``altup_num_inputs`` streams; each layer predicts all of them from
  a learned mix, runs on the active one, and corrects the others with the innovation; the model
  spreads the embedding into the streams at the start (magnitude-matched projections) and folds
  them back (their mean) at the end;
- LAuReL: a low-rank residual beside attention, averaged in with 1/sqrt 2;
- activation sparsity: in the first layers the gate keeps only values above a Gaussian quantile.
"""

from __future__ import annotations

import math

import torch

from trtedge.runtime.models.gemma4 import PleLayer, PleModel, gemma_norm
from trtedge.runtime.models.layers import ACTIVATIONS, GatedMLP, require
from trtedge.runtime.ops.linear import make_linear


class SparseGatedMLP(GatedMLP):
    """down(act(gate) * up) with the gate cut at mean + std x Phi^-1(sparsity) first, when sparse."""

    sparsity = 0.0
    std_multiplier = 0.0

    def sparse(self, sparsity: float) -> SparseGatedMLP:
        self.sparsity = sparsity
        if sparsity > 0:
            normal = torch.distributions.Normal(0.0, 1.0)
            self.std_multiplier = float(normal.icdf(torch.tensor(sparsity, dtype=torch.float32)))
        return self

    def __call__(self, h: torch.Tensor, kernels=None) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        if self.sparsity > 0:
            std, mean = torch.std_mean(gate, dim=-1, keepdim=True, correction=0)
            gate = torch.relu(gate - (mean + std * self.std_multiplier))
        return self.down(ACTIVATIONS[self.act](gate) * up)


class Gemma3nLayer(PleLayer):
    def __init__(self, cfg, index, w, weight_format, shares, mlp):
        super().__init__(cfg, index, w, weight_format, shares, mlp)
        text = cfg.text_config
        self.active = int(text.get("altup_active_idx", 0))
        self.scale_output = bool(text.get("altup_correct_scale", True))
        self.router_scale = 1.0 / cfg.hidden_size
        self.output_scale = require(w, "altup.correct_output_scale").float()
        self.router_norm = require(w, "altup.router_norm.weight").float()
        self.router = make_linear(require(w, "altup.modality_router.weight"), None, weight_format)
        self.predict = make_linear(require(w, "altup.prediction_coefs.weight"), None, "float")
        self.correct = make_linear(require(w, "altup.correction_coefs.weight"), None, "float")
        self.laurel_left = make_linear(require(w, "laurel.linear_left.weight"), None, weight_format)
        self.laurel_right = make_linear(require(w, "laurel.linear_right.weight"), None, weight_format)
        self.norms["post_laurel_norm"] = require(w, "laurel.post_laurel_norm.weight").float()

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.router(gemma_norm(x, self.router_norm, self.eps) * self.router_scale)
        return torch.tanh(routed.float()).to(x.dtype)

    def __call__(self, xs, cos, sin, k_cache, v_cache, batch, ple, step_kv):
        n, t, _ = xs.shape  # [streams, tokens, hidden]
        coefs = self.predict(self.modalities(xs[self.active])).view(t, n, n).transpose(1, 2)
        predictions = torch.matmul(xs.permute(1, 2, 0), coefs).permute(2, 0, 1) + xs
        active = predictions[self.active]
        normed = self.norm(active, "input_layernorm")
        laurel = normed + self.norm(self.laurel_right(self.laurel_left(normed)), "post_laurel_norm")
        h, kv = self.attn(normed, cos, sin, k_cache, v_cache, batch, step_kv)
        x = (active + self.norm(h, "post_attention_layernorm") + laurel) / math.sqrt(2)
        x = x + self.norm(self.mlp(self.norm(x, "pre_feedforward_layernorm")), "post_feedforward_layernorm")
        weights = (self.correct(self.modalities(x)) + 1.0).t().unsqueeze(-1)  # [streams, tokens, 1]
        corrected = (x - active).unsqueeze(0) * weights + predictions
        first = corrected[self.active]
        if self.scale_output:
            first = first * self.output_scale.to(first.dtype)
        return torch.cat([corrected[:1], corrected[1:] + self.add_ple(first, ple)]), kv

    @property
    def linears(self) -> list:
        return super().linears + [self.router, self.laurel_left, self.laurel_right]


class Gemma3nModel(PleModel):
    layer_class = Gemma3nLayer

    def make_mlp(self, index: int, w: dict, weight_format: str):
        sparsity = float((self.text.get("activation_sparsity_pattern") or [0.0] * (index + 1))[index])
        return SparseGatedMLP.from_layer(w, self.cfg.hidden_act, weight_format).sparse(sparsity)

    def make_top(self, top: dict, weight_format: str) -> None:
        n = int(self.text.get("altup_num_inputs", 4))
        self.spread = [
            make_linear(require(top, f"model.altup_projections.{i}.weight"), None, weight_format)
            for i in range(n - 1)
        ]
        self.fold = [
            make_linear(require(top, f"model.altup_unembed_projections.{i}.weight"), None, weight_format)
            for i in range(n - 1)
        ]

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x] + [_match(p(x), x) for p in self.spread])

    def end(self, xs: torch.Tensor) -> torch.Tensor:
        return torch.stack([xs[0]] + [_match(p(x), xs[0]) for p, x in zip(self.fold, xs[1:])]).mean(0)


def _match(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled to the root-mean-square magnitude of ``like`` (per token)."""
    target = torch.mean(like**2, dim=-1, keepdim=True) ** 0.5
    return x * target / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
