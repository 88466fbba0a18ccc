"""Pieces the model families share: norms, rotation, the gated MLP, per-layer weight grouping."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from trtedge.runtime.ops import triton_gemv
from trtedge.runtime.ops.linear import DenseLinear, cat_weights, make_linear

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Same rounding as HF: normalise in float32, cast back, then scale.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def group_by_layer(
    tensors: Iterable[tuple[str, torch.Tensor]],
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device,
    vector_dtype: torch.dtype | None = None,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """HF-named tensors -> (per layer: name inside the layer -> tensor, the other tensors). Matrices
    take ``dtype``; vectors (norms, biases) ``vector_dtype`` (default: ``dtype``)."""
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    top: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if isinstance(tensor, torch.Tensor):  # quantized weights stay as they are (CPU)
            tensor = tensor.to(device=device, dtype=dtype if tensor.dim() > 1 else vector_dtype or dtype)
        m = _LAYER.fullmatch(name)
        if m:
            index = int(m.group(1))
            if index < num_layers:
                per_layer[index][m.group(2)] = tensor
        else:
            top[name] = tensor
    return per_layer, top


def fused(
    w: dict[str, torch.Tensor], name: str, parts: list[str], suffix: str = ".weight"
) -> torch.Tensor | None:
    """One tensor from a checkpoint's fused ``name`` (Phi-3's qkv_proj) or the concatenated ``parts``."""
    if name + suffix in w:
        return w[name + suffix]
    if not all(p + suffix in w for p in parts):
        if suffix == ".weight":
            missing = next(p for p in parts if p + suffix not in w)
            raise ValueError(f"checkpoint has no tensor {missing + suffix!r}")
        return None
    return cat_weights([w[p + suffix] for p in parts])


def rename_prefix(name: str, prefixes: dict[str, str]) -> str:
    """``name`` with the first of ``prefixes`` it starts with replaced (multimodal checkpoints keep the
    text model under their own prefix)."""
    for prefix, replacement in prefixes.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def require(tensors: dict, name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    return tensors[name]


class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate and up in one linear layer."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        act: str,
        weight_format: str,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ):
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = act
        self.gate_up = make_linear(gate_up, gate_up_bias, weight_format)
        self.down = make_linear(down, down_bias, weight_format)
        # TRTEDGE_DECODE_EPILOGUES=1: a decode step's gate_up product applies SiLU-mul in its epilogue
        # where that times faster than the product and the SiLU-mul kernel (opt-in until measured)
        self.silu_epilogue = os.environ.get("TRTEDGE_DECODE_EPILOGUES", "0") == "1"

    @classmethod
    def from_layer(cls, w: dict[str, torch.Tensor], act: str, weight_format: str, prefix: str = "mlp."):
        p = prefix
        return cls(
            fused(w, p + "gate_up_proj", [p + "gate_proj", p + "up_proj"]),
            require(w, p + "down_proj.weight"),
            act,
            weight_format,
            fused(w, p + "gate_up_proj", [p + "gate_proj", p + "up_proj"], ".bias"),
            w.get(p + "down_proj.bias"),
        )

    def __call__(self, h: torch.Tensor, kernels=None) -> torch.Tensor:
        if kernels is not None and self.act == "silu" and self._silu_epilogue(h):
            return self.down(self.gate_up.skinny.silu_gated(h, kernels.silu_mul))
        gate_up = self.gate_up(h)
        if kernels is not None and self.act == "silu":
            act = torch.empty(h.shape[0], gate_up.shape[-1] // 2, dtype=h.dtype, device=h.device)
            kernels.silu_mul(gate_up, act)
            return self.down(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(ACTIVATIONS[self.act](gate) * up)

    def _silu_epilogue(self, h: torch.Tensor) -> bool:
        """Whether the gate_up product can apply SiLU-mul itself (CUDA, dense 16-bit, a few rows)."""
        return (
            self.silu_epilogue
            and type(self.gate_up) is DenseLinear
            and self.gate_up.skinny is not None
            and h.dim() == 2
            and h.shape[0] <= triton_gemv.MAX_ROWS
            and h.is_contiguous()
        )

    @property
    def fuses_decode(self) -> bool:
        """Whether ``fused_decode`` can run (CUDA, dense bf16/fp16 weights, SiLU)."""
        return self.act == "silu" and all(
            type(lin) is DenseLinear and lin.skinny is not None for lin in self.linears
        )

    def fused_decode(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> None:
        """x += this MLP of RMSNorm(x) * norm, for at most 16 decode rows: two products, the norm
        read by the first (its 1/rms applied to the sums), SiLU-mul by the second, which adds
        into x."""
        gate_up = self.gate_up.skinny.fused(x, norm=norm, eps=eps, late_norm=True)
        self.down.skinny.fused(gate_up, silu=True, residual=x)

    @property
    def linears(self) -> list:
        return [self.gate_up, self.down]
