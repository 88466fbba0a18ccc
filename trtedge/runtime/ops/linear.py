"""Linear layers: dense (any dtype), weight-only int8 / int4 for the CPU, and quantized weights on
CUDA (``quant_linear``: fp8, int8, int4).

Quantized weights come as ``QuantizedTensor`` (see ``runtime.quantize``); activations stay
float32. Small batches (decode) run native kernels that read the packed bytes directly; larger ones
(prefill) dequantize the layer, at most ``DEQUANTIZED_TILE_BYTES`` of it at a time, and use the dense
product, except int4 layers where the native kernels have an integer GEMM (AVX2, or AVX-512 on a Zen
core; inputs a multiple of 512; see ``int4_kernel_max_rows``). With ``TRTEDGE_CPU_BF16_TILES`` that
dense product takes bfloat16 operands (``bf16_tiles``: for AMX CPUs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from trtedge.runtime.artifacts.quantize import QuantizedTensor, quantize, quantize_int8
from trtedge.runtime.ops import cpu_kernels, quant_linear, triton_gemv

_KERNEL_MAX_ROWS = 256  # above this, dequantizing once for the BLAS product is faster (int8)
_GGUF_KERNEL_MAX_ROWS = 64
_BF16_KERNEL_MAX_ROWS = 64
# A prefill product dequantizes at most this much of its weight (float32) at a time: an 8B model's
# gate_up is 0.44 GiB of floats, held whole beside the model for each product; in tiles this large
# each tile is still one large BLAS product (a 1B model's layers are one tile).
DEQUANTIZED_TILE_BYTES = 128 * 2**20


_bf16_tiles: bool | None = None


def bf16_tiles() -> bool:
    """Whether a prefill product multiplies its dequantized tiles in bfloat16 on the CPU (oneDNN, through
    torch; on an Intel Xeon with AMX at 2 threads torch's bf16 product ran 401 against 204 GFLOP/s in
    float32). Opt-in until an AMX machine has measured it end to end: ``TRTEDGE_CPU_BF16_TILES=1`` on,
    ``=auto`` where the CPU has AMX's bf16 tiles, otherwise off."""
    global _bf16_tiles
    if _bf16_tiles is None:
        setting = os.environ.get("TRTEDGE_CPU_BF16_TILES", "0")
        if setting == "auto":
            _bf16_tiles = "amx_bf16" in cpu_kernels.cpu_flags() and torch.backends.mkldnn.is_available()
        else:
            _bf16_tiles = setting == "1"
    return _bf16_tiles


def _tile_product(rows: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """rows @ weight.T + bias in float32, or, on the CPU with bf16 tiles, from bfloat16 operands with
    float32 sums (the bias added in float32)."""
    if rows.device.type != "cpu" or not bf16_tiles():
        return F.linear(rows, weight, bias)
    out = F.linear(rows.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
    return out if bias is None else out.add_(bias)


def dequantized_linear(rows: torch.Tensor, q: QuantizedTensor, bias, dequantize) -> torch.Tensor:
    """rows [M, K] @ dequantize(q).T + bias, dequantizing at most DEQUANTIZED_TILE_BYTES at a time."""
    n, k = q.shape
    step = max(1, DEQUANTIZED_TILE_BYTES // (4 * k))
    if n <= step:
        return _tile_product(rows, dequantize(q), bias)
    out = torch.empty(rows.shape[0], n, dtype=torch.float32, device=rows.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        part = None if bias is None else bias[lo:hi]
        out[:, lo:hi] = _tile_product(rows, dequantize(q.row_slice(lo, hi)), part)
    return out


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        self.bias = bias
        # CUDA decode (a few rows): a Triton split-K product that streams the weight at bandwidth.
        self.skinny = triton_gemv.SkinnyLinear(weight, bias) if triton_gemv.usable(weight) else None
        # bfloat16 weights on the CPU take float32 activations: few rows run the native kernel
        self.lib = None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            self.weight = weight.contiguous()
            self.lib = cpu_kernels.load()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.numel() <= triton_gemv.MAX_ROWS * x.shape[-1]:
            return self.skinny(x)
        if x.dtype != self.weight.dtype:
            return self._mixed(x)
        return F.linear(x, self.weight, self.bias)

    def _mixed(self, x: torch.Tensor) -> torch.Tensor:
        """Low-precision weights, float32 activations (the CPU): the activations are rounded to the
        weights' dtype, the products summed and returned in float32. (A bfloat16 product returns
        bfloat16, and that rounding, layer after layer, changes a small model's greedy answers.)"""
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.lib is not None and rows.shape[0] <= _BF16_KERNEL_MAX_ROWS:
            out = cpu_kernels.bf16_linear(self.lib, rows.contiguous(), self.weight, self.bias)
        else:
            out = F.linear(rows.to(self.weight.dtype).float(), self.weight.float(), self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear:
    def __init__(self, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None, lib):
        q = weight if isinstance(weight, QuantizedTensor) else quantize_int8(weight)
        self.quantized = q
        self.qweight, self.scale = q.data, q.scale.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.lib = lib

    def dequantized(self) -> torch.Tensor:
        return self.quantized.dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > _KERNEL_MAX_ROWS or self.lib is None:
            out = dequantized_linear(rows, self.quantized, self.bias, QuantizedTensor.dequantize)
        else:
            out = cpu_kernels.int8_linear(self.lib, rows.contiguous(), self.qweight, self.scale, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes


class Int4Linear:
    """Group-32 asymmetric int4 weights (see ``runtime.quantize``)."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None, lib):
        self.quantized = weight
        self.bias = None if bias is None else bias.float().contiguous()
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        # the kernel's weight arguments, resolved once: a decode step calls this ~100 times
        bias_ptr = 0 if self.bias is None else self.bias.data_ptr()
        self._weights = (weight.data.data_ptr(), weight.scale.data_ptr(), weight.min.data_ptr(), bias_ptr)
        self._kernel = None if lib is None else lib.int4_linear
        # past this many rows the layer is dequantized for the BLAS (64, more where the kernels have an
        # integer GEMM for this shape)
        self._kernel_max_rows = (
            0 if lib is None else lib.int4_kernel_max_rows(self.out_features, self.in_features)
        )

    def dequantized(self) -> torch.Tensor:
        return self._dequantize(self.quantized)

    def _dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        return q.dequantize() if self.lib is None else cpu_kernels.int4_dequantize(self.lib, q)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        if m > self._kernel_max_rows or self._kernel is None:
            out = dequantized_linear(rows, self.quantized, self.bias, self._dequantize)
        else:
            if rows.dtype != torch.float32 or not rows.is_contiguous():
                rows = rows.float().contiguous()
            out = torch.empty(m, self.out_features)
            self._kernel(
                rows.data_ptr(), m, self.in_features, *self._weights, out.data_ptr(), self.out_features
            )
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes


class GgufLinear:
    """A GGUF file's Q8_0 / Q4_K / Q5_K / Q6_K blocks as it holds them (see ``runtime.quantize``)."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None, lib):
        self.quantized = weight
        self.bias = None if bias is None else bias.float().contiguous()
        self.lib = lib
        self.out_features, self.in_features = weight.shape

    def dequantized(self) -> torch.Tensor:
        return self.quantized.dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > _GGUF_KERNEL_MAX_ROWS or self.lib is None:
            out = dequantized_linear(rows.float(), self.quantized, self.bias, QuantizedTensor.dequantize)
        else:
            out = cpu_kernels.gguf_linear(self.lib, rows.float().contiguous(), self.quantized, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes


def make_linear(weight, bias: torch.Tensor | None, weight_format: str = "float"):
    """A layer for ``weight``: quantized tensors keep their format; float ones are quantized when
    ``weight_format`` is int8 / int4 (load-time quantization of a checkpoint that is not a bundle)."""
    if not isinstance(weight, QuantizedTensor) and weight_format in ("int8", "int4"):
        weight = quantize(weight, weight_format)
    if isinstance(weight, QuantizedTensor):
        if weight.device.type == "cuda":
            return quant_linear.make(weight, bias)
        if weight.format == "fp8":
            raise ValueError("fp8 weights run on CUDA only; the loader dequantizes them on the CPU")
        lib = cpu_kernels.load()
        if weight.format == "gguf":
            return GgufLinear(weight, bias, lib)
        return Int4Linear(weight, bias, lib) if weight.format == "int4" else Int8Linear(weight, bias, lib)
    return DenseLinear(weight, bias)


def cat_weights(parts: list) -> torch.Tensor | QuantizedTensor:
    """Concatenate the rows of weights (fused qkv / gate_up): float, or quantized in one format
    (mixed formats are requantized to int8)."""
    if not any(isinstance(p, QuantizedTensor) for p in parts):
        return torch.cat(parts)
    formats = {p.format if isinstance(p, QuantizedTensor) else "float" for p in parts}
    if len(formats) > 1:
        parts = [quantize_int8(p.dequantize() if isinstance(p, QuantizedTensor) else p) for p in parts]
    return QuantizedTensor.cat(parts)


def embedding(ids: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, QuantizedTensor):
        return weight.rows(ids)
    return F.embedding(ids, weight)


def int8_available() -> bool:
    """True when the native int8 kernels compiled and loaded on this machine."""
    return cpu_kernels.load() is not None
