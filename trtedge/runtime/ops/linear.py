"""Linear layers: dense (any dtype) and int8 weight-only for the CPU.

Int8 weights keep one float32 scale per output row; activations stay float32. Small batches
(decode) run a native kernel that reads the int8 bytes directly; larger ones (prefill) dequantize
the layer and use the dense product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtedge.runtime.ops import cpu_kernels, triton_gemv

_KERNEL_MAX_ROWS = 256  # above this, dequantizing once for the BLAS product is faster


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        self.bias = bias
        # CUDA decode (a few rows): a Triton split-K product that streams the weight at bandwidth.
        self.skinny = triton_gemv.SkinnyLinear(weight, bias) if triton_gemv.usable(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.numel() <= triton_gemv.MAX_ROWS * x.shape[-1]:
            return self.skinny(x)
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (int8 weight, float32 scale per row)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib):
        self.qweight, self.scale = quantize_int8(weight)
        self.bias = None if bias is None else bias.float().contiguous()
        self.lib = lib

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > _KERNEL_MAX_ROWS:
            out = F.linear(rows, self.dequantized(), self.bias)
        else:
            out = cpu_kernels.int8_linear(self.lib, rows.contiguous(), self.qweight, self.scale, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + 4 * self.scale.numel()


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, weight_format: str):
    if weight_format == "int8":
        return Int8Linear(weight, bias, cpu_kernels.load())
    return DenseLinear(weight, bias)


def int8_available() -> bool:
    """True when the native int8 kernels compiled and loaded on this machine."""
    return cpu_kernels.load() is not None
