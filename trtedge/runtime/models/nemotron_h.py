"""NVIDIA Nemotron-H hybrids: one mixer per layer, as ``layers_block_type`` types it — Mamba-2 (short
causal conv1d + the selective state space, one recurrent state per sequence), attention without
positional encoding over the paged KV cache, a squared-ReLU MLP, or routed MoE (sigmoid router with a
correction bias and group-limited top-k, non-gated experts, a shared expert). Each layer is
``x + mixer(rms_norm(x))``. Multi-token-prediction weights are skipped (the ``mtp`` speculative method
loads them itself: speculative/mtp.py)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.executor.state_pool import RecurrentBatch, WindowPlan, chain_steps, copy_states
from trtedge.runtime.models.config import ModelConfig, UnsupportedModelError
from trtedge.runtime.models.layers import ACTIVATIONS, require
from trtedge.runtime.models.nemotron_omni import (
    UNUSED_PREFIXES,
    RadioVideoEncoder,
    is_omni_vision_tensor,
    omni_vision_name,
)
from trtedge.runtime.ops import gated_delta as gd
from trtedge.runtime.ops import ssd, triton_attention, triton_gemv, triton_moe_decode, triton_recurrent
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import DenseLinear, cat_weights, make_linear

log = logging.getLogger("trtedge")

_LAYER = re.compile(r"(?:backbone|model)\.layers\.(\d+)\.(.+)")
_SKIPPED = ("mtp.",)
_ACTIVATIONS = {**ACTIVATIONS, "relu2": lambda x: F.relu(x).square(), "relu": F.relu}


@dataclass(frozen=True)
class NemotronHSpec:
    """The config.json fields of the Mamba-2 and MoE layers (names as transformers' NemotronHConfig)."""

    layer_types: tuple[str, ...]
    num_heads: int  # Mamba heads
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int
    dt_min: float  # transformers clamps the discretised step from below (time_step_min)
    mlp_act: str
    mlp_bias: bool
    num_experts: int
    top_k: int
    num_expert_groups: int
    top_k_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> NemotronHSpec:
        c = cfg.text_config or {}
        spec = cls(
            layer_types=tuple(c["layers_block_type"]),
            num_heads=int(c.get("mamba_num_heads", 128)),
            head_dim=int(c.get("mamba_head_dim", 64)),
            state_size=int(c.get("ssm_state_size", 128)),
            num_groups=int(c.get("n_groups", c.get("mamba_n_groups", 8))),
            conv_kernel=int(c.get("conv_kernel", c.get("mamba_d_conv", 4))),
            chunk_size=int(c.get("chunk_size", c.get("mamba_chunk_size", 128))),
            dt_min=float(c.get("time_step_min", c.get("mamba_dt_min", 0.001))),
            mlp_act=str(c.get("mlp_hidden_act", "relu2")),
            mlp_bias=bool(c.get("mlp_bias", False)),
            num_experts=int(c.get("n_routed_experts", 8)),
            top_k=int(c.get("num_experts_per_tok", 2)),
            num_expert_groups=int(c.get("n_group", 1)),
            top_k_groups=int(c.get("topk_group", 1)),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        )
        if spec.num_heads % spec.num_groups:
            raise UnsupportedModelError("mamba_num_heads must be a multiple of n_groups")
        if spec.mlp_act not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"mlp_hidden_act: unsupported {spec.mlp_act!r}; supported: {', '.join(_ACTIVATIONS)}"
            )
        if "moe" in spec.layer_types and spec.num_experts % spec.num_expert_groups:
            raise UnsupportedModelError("n_routed_experts must be a multiple of n_group")
        return spec

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise and scale in float32, then cast (Nemotron-H's rounding)."""
    return (F.rms_norm(x.float(), weight.shape, None, eps) * weight).to(x.dtype)


class Mamba2Mixer:
    def __init__(self, spec: NemotronHSpec, w: dict[str, torch.Tensor], weight_format: str, index: int, eps):
        self.spec, self.index, self.eps = spec, index, eps  # index: among the Mamba layers (the pool's)
        p = "mixer."
        self.in_proj = make_linear(w[p + "in_proj.weight"], w.get(p + "in_proj.bias"), weight_format)
        self.splits = [spec.inner_size, spec.conv_dim, spec.num_heads]
        self.conv_weight = w[p + "conv1d.weight"].squeeze(1)  # [C, K]
        self.conv_bias = w.get(p + "conv1d.bias")
        self.a = -w[p + "A_log"].float().exp()
        self.dt_bias = w[p + "dt_bias"].float()
        self.d = w[p + "D"].float()
        self.norm = w[p + "norm.weight"]
        self.out_proj = make_linear(w[p + "out_proj.weight"], w.get(p + "out_proj.bias"), weight_format)
        # CUDA: decode steps run the fused Triton kernels (in place on the state pool), every step the
        # fused gated norm
        self.fused = self.conv_weight.is_cuda and triton_recurrent.available()

    @property
    def linears(self) -> list:
        return [self.in_proj, self.out_proj]

    def __call__(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        return self.out_proj(self.mix(self.in_proj(x), batch))

    def mix(self, proj: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """From the input projection [T, ...] to the output projection's input [T, inner_size]."""
        spec, t, dtype = self.spec, proj.shape[0], proj.dtype
        z, xbc, dt = proj.split(self.splits, dim=-1)
        conv, ssm = batch.pool.conv[self.index], batch.pool.ssm[self.index]
        if batch.is_decode and self.fused:
            rows, chain = batch.rows_tensor, batch.chains(self.index)
            activated = triton_recurrent.conv_step(xbc, conv, rows, self.conv_weight, self.conv_bias, chain)
            y = triton_recurrent.ssm_step(
                activated, dt, self.dt_bias, self.a, self.d, spec.dt_min, ssm, rows, spec.num_groups, chain
            )
            for i, ckpt in enumerate(batch.checkpoints):
                if ckpt is not None:
                    conv[ckpt[1]], ssm[ckpt[1]] = conv[batch.rows[i]], ssm[batch.rows[i]]
            return self._gate(y, z, dtype)
        batch.require_eager()
        dt = F.softplus(dt.float() + self.dt_bias).clamp(min=spec.dt_min)
        if batch.is_decode:
            chain = batch.chains(self.index)
            if chain is None:
                y = self._step(xbc, dt, conv, ssm, batch.rows_tensor)
            else:  # verify chains (the fused kernels' reference): token by token, every kept state saved
                y = xbc.new_empty(t, spec.num_heads, spec.head_dim, dtype=torch.float32)
                for index, rows, keep, saves in chain_steps(chain, batch.rows_tensor):
                    y[index] = self._step(xbc[index], dt[index], conv, ssm, rows)
                    copy_states((chain.conv, chain.ssm), saves, (conv, ssm), rows[keep])
            for i, ckpt in enumerate(batch.checkpoints):
                if ckpt is not None:
                    conv[ckpt[1]], ssm[ckpt[1]] = conv[batch.rows[i]], ssm[batch.rows[i]]
        else:
            y = torch.empty(t, spec.num_heads, spec.head_dim, dtype=torch.float32, device=proj.device)
            windows = batch.windows or [0] * len(batch.rows)
            start = 0
            for row, n, ckpt, w in zip(batch.rows, batch.query_lens, batch.checkpoints, windows):
                head = n - w  # tokens before the verification window: chunked
                if head:
                    end = start + head
                    ckpt = ckpt if ckpt is not None and ckpt[0] <= head else None
                    y[start:end] = self._prefill(xbc[start:end], dt[start:end], conv, ssm, row, ckpt)
                start += n
            if batch.plan is not None:
                self._windows(xbc, dt, conv, ssm, y, batch.plan)
        return self._gate(y, z, dtype)

    def _gate(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated RMSNorm, norm(y * silu(z)) over each group of channels in float32: [T, inner_size]."""
        spec, t, g = self.spec, y.shape[0], self.spec.num_groups
        if self.fused:
            return triton_recurrent.gated_norm(y.view(t, -1), z, self.norm, self.eps, g, True, dtype)
        y = y.reshape(t, spec.inner_size) * F.silu(z.float())
        y = F.rms_norm(y.view(t, g, -1), (spec.inner_size // g,), None, self.eps).view(t, -1)
        return self.norm * y.to(dtype)

    def _split(self, activated: torch.Tensor):
        spec, t = self.spec, activated.shape[0]
        xs, b, c = activated.split(
            [spec.inner_size, spec.num_groups * spec.state_size, spec.num_groups * spec.state_size], dim=-1
        )
        rep = spec.num_heads // spec.num_groups  # each group serves `rep` consecutive heads
        b, c = (gd.repeat_heads(v.reshape(t, spec.num_groups, -1), rep) for v in (b, c))
        return xs.reshape(t, spec.num_heads, spec.head_dim), b, c

    def _scan(self, xs, dt, b, c, state):
        out, state = ssd.chunk_scan(xs, dt, self.a, b, c, state, self.spec.chunk_size)
        return out + self.d[:, None] * xs.float(), state

    def _prefill(self, xbc, dt, conv, ssm, row: int, ckpt: tuple[int, int] | None) -> torch.Tensor:
        n, k = xbc.shape[0], self.spec.conv_kernel
        activated, padded = gd.causal_conv(xbc, conv[row], self.conv_weight, self.conv_bias)
        xs, b, c = self._split(activated)
        state = ssm[row]
        if ckpt is not None and ckpt[0] < n:  # stop at the checkpoint, save it, go on
            r, dst = ckpt
            head, state = self._scan(xs[:r], dt[:r], b[:r], c[:r], state)
            conv[dst] = padded[r : r + k - 1]
            ssm[dst] = state
            tail, state = self._scan(xs[r:], dt[r:], b[r:], c[r:], state)
            out = torch.cat([head, tail])
        else:
            out, state = self._scan(xs, dt, b, c, state)
        conv[row] = padded[n:]
        ssm[row] = state
        if ckpt is not None and ckpt[0] == n:
            conv[ckpt[1]], ssm[ckpt[1]] = conv[row], state
        return out

    def _step(self, xbc, dt, conv, ssm, rows: torch.Tensor) -> torch.Tensor:
        """One token for each sequence whose live state is at ``rows``: the recurrent update."""
        activated, new_conv = gd.causal_conv_step(
            xbc, conv.index_select(0, rows), self.conv_weight, self.conv_bias
        )
        conv.index_copy_(0, rows, new_conv.to(conv.dtype))
        xs, b, c = self._split(activated)
        out, state = ssd.recurrent_step(xs, dt, self.a, b, c, ssm.index_select(0, rows))
        ssm.index_copy_(0, rows, state)
        return out + self.d[:, None] * xs.float()

    def _windows(self, xbc, dt, conv, ssm, out, plan: WindowPlan) -> None:
        """Verification windows token by token, keeping the state after each in the plan's scratch."""
        saved_conv, saved_ssm = plan.conv[self.index], plan.ssm[self.index]
        for step in plan.steps:
            i = step.index
            out[i] = self._step(xbc[i], dt[i], conv, ssm, step.rows)
            copy_states((saved_conv, saved_ssm), step.saves, (conv, ssm), step.rows)
            if step.checkpoints is not None:
                src, dst = step.checkpoints
                copy_states((conv, ssm), dst, (conv, ssm), src)


class Attention:
    """Grouped-query attention without positional encoding (Nemotron-H's attention layers)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], weight_format: str):
        self.cfg = cfg
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        names = [f"mixer.{n}_proj" for n in "qkv"]
        biases = [w.get(n + ".bias") for n in names]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        self.qkv = make_linear(cat_weights([require(w, n + ".weight") for n in names]), bias, weight_format)
        self.o = make_linear(require(w, "mixer.o_proj.weight"), w.get("mixer.o_proj.bias"), weight_format)
        cuda = w["mixer.o_proj.weight"].device.type == "cuda" and triton_attention.available()
        self.attention = (CudaAttention if cuda else TorchAttention)(cfg.head_dim**-0.5)

    @property
    def linears(self) -> list:
        return [self.qkv, self.o]

    def __call__(self, x, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        return self.o(self.attend(self.qkv(x), k_cache, v_cache, batch))

    def attend(self, qkv, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """From the qkv projection [T, ...] to the output projection's input [T, q_size]."""
        cfg, t = self.cfg, qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        shape = (t, cfg.num_kv_heads, cfg.head_dim)
        o = self.attention(
            q.view(t, cfg.num_heads, cfg.head_dim), k.view(shape), v.view(shape), k_cache, v_cache, batch
        )
        return o.reshape(t, self.q_size)


class MLP:
    """``down(act(up(x)))``: no gate (squared ReLU in Nemotron-H)."""

    def __init__(self, up, down, act: str):
        self.up, self.down, self.act = up, down, _ACTIVATIONS[act]

    @classmethod
    def from_layer(cls, w: dict, prefix: str, act: str, weight_format: str) -> MLP:
        return cls(
            make_linear(require(w, prefix + "up_proj.weight"), w.get(prefix + "up_proj.bias"), weight_format),
            make_linear(
                require(w, prefix + "down_proj.weight"), w.get(prefix + "down_proj.bias"), weight_format
            ),
            act,
        )

    @property
    def linears(self) -> list:
        return [self.up, self.down]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class RoutedMoE:
    """Sigmoid scores plus a correction bias choose the experts (within the best ``topk_group`` of
    ``n_group`` groups); the chosen experts' plain scores, renormalised and scaled, weigh them. An
    optional latent projection wraps the experts; the shared expert sees the layer's input."""

    def __init__(self, spec: NemotronHSpec, w: dict[str, torch.Tensor], weight_format: str, dtype):
        self.spec = spec
        p = "mixer."
        self.router = _float(require(w, p + "gate.weight"), torch.float32)
        bias = w.get(p + "gate.e_score_correction_bias")
        self.bias = torch.zeros(spec.num_experts, device=self.router.device) if bias is None else bias.float()
        if p + "experts.up_proj" in w:  # transformers' fused layout: [E, I, H] and [E, H, I]
            ups, downs = w[p + "experts.up_proj"].unbind(0), w[p + "experts.down_proj"].unbind(0)
        else:
            ups = [require(w, f"{p}experts.{e}.up_proj.weight") for e in range(spec.num_experts)]
            downs = [require(w, f"{p}experts.{e}.down_proj.weight") for e in range(spec.num_experts)]
        # CUDA, float weights: one grouped Triton launch per projection over all experts, nothing read
        # back to the host (decode steps stay capturable); the per-expert layers are views of the stacks.
        self.w_up = self.w_down = None
        if weight_format == "float" and ups[0].device.type == "cuda" and triton_attention.available():
            # a pre-quantized checkpoint's experts run dequantized there (its other projections in fp8)
            ups, downs = [_float(t, dtype) for t in ups], [_float(t, dtype) for t in downs]
            self.w_up, ups = _stacked(w, p, "up_proj", ups)
            self.w_down, downs = _stacked(w, p, "down_proj", downs)
        self.experts = [
            MLP(make_linear(u, None, weight_format), make_linear(d, None, weight_format), spec.mlp_act)
            for u, d in zip(ups, downs)
        ]
        self.shared = MLP.from_layer(w, p + "shared_experts.", spec.mlp_act, weight_format)
        self.latent_in = self.latent_out = None
        if p + "fc1_latent_proj.weight" in w:
            self.latent_in = make_linear(
                w[p + "fc1_latent_proj.weight"], w.get(p + "fc1_latent_proj.bias"), weight_format
            )
            self.latent_out = make_linear(
                w[p + "fc2_latent_proj.weight"], w.get(p + "fc2_latent_proj.bias"), weight_format
            )

    @property
    def linears(self) -> list:
        latent = [self.latent_in, self.latent_out] if self.latent_in is not None else []
        return [m for e in self.experts for m in e.linears] + self.shared.linears + latent

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        spec, t = self.spec, h.shape[0]
        scores = F.linear(h.float(), self.router).sigmoid()
        choice = scores + self.bias
        if spec.num_expert_groups > 1:
            groups = choice.view(t, spec.num_expert_groups, -1)
            best = (
                groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1).topk(spec.top_k_groups, dim=-1)
            )
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best.indices, True)
            choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)
        ids = choice.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * spec.routed_scaling_factor, ids

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        # decode-sized batches on CUDA: one launch routes, one per projection runs the chosen experts
        pairs = self.w_up is not None and h.shape[0] * spec.top_k <= triton_moe_decode.MAX_PAIRS
        if pairs and spec.num_expert_groups == 1:
            weights, ids = triton_moe_decode.sigmoid_route(
                h, self.router, self.bias, spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor
            )
        else:
            weights, ids = self.route(h)
        x = h if self.latent_in is None else self.latent_in(h)
        if pairs:
            out = self._pairs(x, weights, ids)
        elif self.w_up is not None:
            out = self._grouped(x, weights, ids)
        else:
            out = self._per_expert(x, weights, ids)
        out = out.to(h.dtype)
        if self.latent_out is not None:
            out = self.latent_out(out)
        return out + self.shared(h)

    def _pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        up = triton_moe_decode.pair_gemv(x, self.w_up, ids, k)
        relu2 = self.spec.mlp_act == "relu2"
        if not relu2:
            up = _ACTIVATIONS[self.spec.mlp_act](up)
        y = triton_moe_decode.pair_gemv(up, self.w_down, ids, 1, scale=weights.flatten(), relu2_in=relu2)
        return y.view(t, k, -1).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from trtedge.runtime.ops.triton_moe import align_by_expert, grouped_matmul

        t, k = ids.shape
        block_m = 16 if t * k <= 256 else 64
        sorted_rows, block_expert = align_by_expert(ids, self.spec.num_experts, block_m)
        up = grouped_matmul(x, self.w_up, sorted_rows, block_expert, t * k, k, block_m)
        act = _ACTIVATIONS[self.spec.mlp_act]
        y = grouped_matmul(
            act(up), self.w_down, sorted_rows, block_expert, t * k, 1, block_m, weights.flatten()
        )
        return y.view(t, k, -1).float().sum(dim=1)

    def _per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The oracle: (token, slot) pairs sorted by expert, one matmul pair per expert with tokens."""
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        scale = weights.flatten()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if count:
                pairs = order[start : start + count]
                start += count
                rows = pairs // self.spec.top_k
                out.index_add_(0, rows, self.experts[e](x[rows]).float() * scale[pairs, None])
        return out


def _float(t, dtype: torch.dtype) -> torch.Tensor:
    """A weight that runs in floating point (a router, an expert of the grouped kernel): dequantized
    to ``dtype`` if it came quantized."""
    return t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t


def _stacked(w: dict, prefix: str, name: str, parts: list) -> tuple[torch.Tensor, tuple]:
    """The experts' ``name`` weights as one [E, rows, columns] tensor and its per-expert views; the
    loaded per-expert tensors leave ``w`` as they are stacked (a 30B-A3B checkpoint's experts would
    otherwise sit on the device twice until the model is built)."""
    fused = w.get(prefix + "experts." + name)
    if fused is not None:
        stack = fused.contiguous()
    else:
        stack = torch.stack(parts)
        parts.clear()
        for e in range(len(stack)):
            w.pop(f"{prefix}experts.{e}.{name}.weight", None)
    return stack, stack.unbind(0)


class NemotronHLayer:
    def __init__(self, kind: str, norm: torch.Tensor, mixer):
        self.kind, self.norm, self.mixer = kind, norm, mixer

    @property
    def linears(self) -> list:
        return self.mixer.linears


class NemotronHModel:
    """A hybrid decoder: ``forward`` takes the paged KV caches of the attention layers (in order) and a
    ``RecurrentBatch`` naming each sequence's row of the recurrent-state pool (the Mamba layers')."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = "float",
        max_positions: int = 8192,
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.spec = spec = NemotronHSpec.from_config(cfg)
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
        top: dict[str, torch.Tensor] = {}
        vision: dict[str, torch.Tensor] = {}  # Nemotron Omni: the video tower and projector
        skipped = 0
        for name, tensor in tensors:
            name = name.removeprefix("language_model.")  # Nemotron Omni's decoder
            if is_omni_vision_tensor(name):
                vision[omni_vision_name(name)] = _float(tensor, dtype)
                continue
            if name.startswith(UNUSED_PREFIXES):  # Nemotron Omni's audio branch: not served
                continue
            if name.startswith(_SKIPPED):
                skipped += 1
                continue
            keep_fp32 = name.endswith(("A_log", "dt_bias", ".D", "gate.weight", "e_score_correction_bias"))
            if isinstance(tensor, torch.Tensor):  # quantized ones come on the device, in the format they run
                tensor = tensor.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
            m = _LAYER.fullmatch(name)
            if m:
                if int(m.group(1)) < cfg.num_layers:
                    per_layer[int(m.group(1))][m.group(2)] = tensor
            else:
                top[name.replace("backbone.", "model.", 1)] = tensor
        if skipped:
            log.info("nemotron_h: skipped %d multi-token-prediction tensors", skipped)
        self.vision = None
        if vision and cfg.vision is not None:
            self.vision = RadioVideoEncoder(cfg.vision, vision, dtype, device)
        self.embed = _float(require(top, "model.embeddings.weight"), dtype)
        self.norm = require(top, "model.norm_f.weight").float()
        head = top.get("lm_head.weight")
        self.lm_head = make_linear(
            self.embed if head is None or cfg.tie_word_embeddings else head, None, weight_format
        )
        self.layers: list[NemotronHLayer] = []
        num_mamba = 0
        for kind, w in zip(spec.layer_types, per_layer):
            if kind == "linear_attention":
                mixer = Mamba2Mixer(spec, w, weight_format, num_mamba, cfg.rms_norm_eps)
                num_mamba += 1
            elif kind == "full_attention":
                mixer = Attention(cfg, w, weight_format)
            elif kind == "moe":
                mixer = RoutedMoE(spec, w, weight_format, dtype)
            else:
                mixer = MLP.from_layer(w, "mixer.", spec.mlp_act, weight_format)
            self.layers.append(NemotronHLayer(kind, require(w, "norm.weight").float(), mixer))
        self.num_mamba_layers = num_mamba
        self.num_kv_layers = sum(kind == "full_attention" for kind in spec.layer_types)
        self.decode_kernels = None
        # CUDA, bf16/fp16 dense weights, at most 16 rows: the norms and residual adds (and Qwen3.5's
        # SiLU-mul) of a decode step can run inside the products; only with TRTEDGE_DECODE_FUSION=1, as
        # for the llama family (fused_products may be switched, the decode graphs captured again)
        self.can_fuse_products = device.type == "cuda" and all(_products_fuse(layer) for layer in self.layers)
        self.fused_products = self.can_fuse_products and os.environ.get("TRTEDGE_DECODE_FUSION") == "1"
        # CUDA decode steps: each residual add and the RMSNorm after it in one launch
        self.norm_kernels = None
        if device.type == "cuda" and triton_attention.available():
            from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

            self.norm_kernels = TritonDecodeKernels()
        self.aux_layers: tuple[int, ...] = ()  # no EAGLE-3 hidden-state taps
        # MTP drafting reads the final (normed) hidden states of every forward: kept in aux_hidden
        self.keep_hidden = False
        self.aux_hidden: torch.Tensor | None = None

    def state_spec(self) -> dict:
        """Shapes of one sequence's recurrent state, per Mamba layer: the conv inputs and [H, P, N]."""
        spec = self.spec
        return {
            "num_layers": self.num_mamba_layers,
            "conv_shape": (spec.conv_kernel - 1, spec.conv_dim),
            "conv_dtype": self.dtype,
            "ssm_shape": (spec.num_heads, spec.head_dim, spec.state_size),
        }

    def forward(
        self, input_ids, positions, kv_caches, batch: AttentionBatch, states: RecurrentBatch, embeds=None
    ) -> torch.Tensor:
        """``embeds``: (rows, values) that replace the token embeddings of those rows (video tokens)."""
        x = F.embedding(input_ids, self.embed)
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        caches = iter(kv_caches)
        eps = self.cfg.rms_norm_eps
        fused = self.fused_products and states.is_decode and x.shape[0] <= triton_gemv.MAX_ROWS
        if self.norm_kernels is not None and states.is_decode and not fused:
            return self._decode_with_kernels(x, caches, batch, states)
        for layer in self.layers:
            if fused and layer.kind in ("linear_attention", "full_attention"):
                mixer = layer.mixer
                if layer.kind == "linear_attention":
                    o = mixer.mix(mixer.in_proj.skinny.fused(x, norm=layer.norm, eps=eps), states)
                    mixer.out_proj.skinny.fused(o, residual=x)
                else:
                    k_cache, v_cache = next(caches)
                    qkv = mixer.qkv.skinny.fused(x, norm=layer.norm, eps=eps)
                    mixer.o.skinny.fused(mixer.attend(qkv, k_cache, v_cache, batch), residual=x)
                continue
            if fused:  # MoE and MLP layers: the norm in one launch, the residual added in place
                h = torch.empty_like(x)
                self.norm_kernels.add_rms_norm(x, None, layer.norm, h, eps)
                x.add_(layer.mixer(h))
                continue
            h = rms_norm(x, layer.norm, eps)
            if layer.kind == "linear_attention":
                x = x + layer.mixer(h, states)
            elif layer.kind == "full_attention":
                k_cache, v_cache = next(caches)
                x = x + layer.mixer(h, k_cache, v_cache, batch)
            else:
                x = x + layer.mixer(h)
        if fused:
            out = torch.empty_like(x)
            self.norm_kernels.add_rms_norm(x, None, self.norm, out, eps)
        else:
            out = rms_norm(x, self.norm, eps)
        if self.keep_hidden:
            self.aux_hidden = out
        return out

    def _decode_with_kernels(self, x, caches, batch, states) -> torch.Tensor:
        """A CUDA decode step whose residual adds run with the RMSNorm after them (add_rms_norm, x in
        place)."""
        kernels, eps = self.norm_kernels, self.cfg.rms_norm_eps
        h, delta = torch.empty_like(x), None
        for layer in self.layers:
            kernels.add_rms_norm(x, delta, layer.norm, h, eps)
            if layer.kind == "linear_attention":
                delta = layer.mixer(h, states)
            elif layer.kind == "full_attention":
                k_cache, v_cache = next(caches)
                delta = layer.mixer(h, k_cache, v_cache, batch)
            else:
                delta = layer.mixer(h)
        out = torch.empty_like(x)
        kernels.add_rms_norm(x, delta, self.norm, out, eps)
        if self.keep_hidden:
            self.aux_hidden = out
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weight_bytes(self) -> int:
        vision = self.vision.weight_bytes if self.vision is not None else 0
        return vision + sum(
            m.nbytes for m in [self.lm_head] + [m for layer in self.layers for m in layer.linears]
        )


def _products_fuse(layer: NemotronHLayer) -> bool:
    """Whether a Mamba or attention layer's decode products can take its norm and residual add."""
    if layer.kind not in ("linear_attention", "full_attention"):
        return True
    return all(type(lin) is DenseLinear and lin.skinny is not None for lin in layer.linears)


def nemotron_h_dummy_tensors(cfg: ModelConfig, rand, ones):
    """Random weights in the checkpoint's names for ``dummy_tensors`` (norms and D 1, A_log 0, so
    every Mamba head decays by exp(-dt) per token; router bias 0)."""
    spec, h = NemotronHSpec.from_config(cfg), cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    text = cfg.text_config or {}
    yield "backbone.embeddings.weight", rand(cfg.vocab_size, h)
    yield "backbone.norm_f.weight", ones(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", rand(cfg.vocab_size, h)
    for i, kind in enumerate(spec.layer_types):
        p = f"backbone.layers.{i}."
        yield p + "norm.weight", ones(h)
        if kind == "linear_attention":
            shapes = {
                "in_proj.weight": (spec.inner_size + spec.conv_dim + spec.num_heads, h),
                "conv1d.weight": (spec.conv_dim, 1, spec.conv_kernel),
                "out_proj.weight": (h, spec.inner_size),
            }
            vectors = {
                "conv1d.bias": spec.conv_dim,
                "dt_bias": spec.num_heads,
                "norm.weight": spec.inner_size,
            }
            yield p + "mixer.A_log", ones(spec.num_heads) - 1
            yield p + "mixer.D", ones(spec.num_heads)
        elif kind == "full_attention":
            shapes = {
                "q_proj.weight": (q, h),
                "k_proj.weight": (kv, h),
                "v_proj.weight": (kv, h),
                "o_proj.weight": (h, q),
            }
            vectors = {}
        elif kind == "mlp":
            n = cfg.intermediate_size
            shapes, vectors = {"up_proj.weight": (n, h), "down_proj.weight": (h, n)}, {}
        else:
            n, shared = (
                int(text.get("moe_intermediate_size", 0)),
                int(text.get("moe_shared_expert_intermediate_size", 0)),
            )
            width = int(text.get("moe_latent_size") or h)
            shapes = {"gate.weight": (spec.num_experts, h)}
            shapes.update(
                {"shared_experts.up_proj.weight": (shared, h), "shared_experts.down_proj.weight": (h, shared)}
            )
            for e in range(spec.num_experts):
                shapes.update(
                    {f"experts.{e}.up_proj.weight": (n, width), f"experts.{e}.down_proj.weight": (width, n)}
                )
            if width != h:
                shapes.update({"fc1_latent_proj.weight": (width, h), "fc2_latent_proj.weight": (h, width)})
            vectors = {}
            yield p + "mixer.gate.e_score_correction_bias", ones(spec.num_experts) - 1
        for name, shape in shapes.items():
            yield p + "mixer." + name, rand(*shape)
        for name, n in vectors.items():
            yield p + "mixer." + name, ones(n) if name == "norm.weight" else rand(n)
