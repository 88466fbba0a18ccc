"""Linear layers with quantized weights on CUDA: fp8 (E4M3), int8 and group-32 int4.

Decode-sized inputs (up to 64 rows: a decode batch) run the Triton products of ``triton_quant``,
which read the packed weight once per step; each weight times a few tilings once per row bucket (outside any CUDA
graph capture) and keeps the fastest. Larger inputs (prefill): fp8 with one scale per row runs
Hopper's FP8 matrix product (``torch._scaled_mm``, activations scaled per row to E4M3); other fp8,
int8 and int4 weights run the Triton matrix products of ``triton_quant_prefill``, which dequantize
the weight tile by tile in their K loop (no 16-bit copy of the weight).
"""

from __future__ import annotations

import logging

import torch

from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.ops import triton_quant, triton_quant_prefill
from trtedge.runtime.ops.triton_attention import available
from trtedge.runtime.ops.triton_gemv import _bucket, _graph_time

log = logging.getLogger("trtedge")

MAX_ROWS = triton_quant.MAX_ROWS
_DEFAULT_PLAN = triton_quant.DEFAULT_PLAN
_plans: dict[tuple, tuple[int, ...]] = {}
L2_FLUSH_BYTES = 96 << 20  # past the H200's 50 MB L2


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the quantized CUDA layers run: a CUDA device with Triton, 16-bit activations."""
    return device.type == "cuda" and available() and dtype in (torch.bfloat16, torch.float16)


def fp8_supported(device: torch.device) -> bool:
    """E4M3 conversions in Triton need compute capability 8.9 (Ada) or later."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_supported(device: torch.device) -> bool:
    """Row-wise scaled FP8 matrix products (``torch._scaled_mm``): Hopper (9.0) and later."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (9, 0)


class _QuantLinear:
    """A quantized weight [N, K] on CUDA and its optional bias; subclasses supply the products."""

    kind = ""
    table: tuple = ()

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None):
        self.quantized = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.workspace = triton_quant.Workspace(
            self.out_features, self.in_features, self.table, weight.device
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1 or rows.stride(0) != rows.shape[1]:
            rows = rows.contiguous()
        if rows.shape[0] <= triton_quant.BATCH_ROWS:
            out = self.decode(rows, self.plan(rows))
        else:
            out = self.prefill(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def plan(self, rows: torch.Tensor) -> tuple[int, ...]:
        key = (
            self.kind,
            self.out_features,
            self.in_features,
            self.quantized.scale.shape,
            _bucket(rows.shape[0]) if rows.shape[0] <= MAX_ROWS else triton_quant.BATCH_ROWS,
            rows.dtype,
        )
        if key not in _plans:
            if torch.cuda.is_current_stream_capturing():  # no timing inside a capture
                return _DEFAULT_PLAN
            _plans[key] = self._tune(rows.shape[0], rows.dtype)
        return _plans[key]

    def _tune(self, rows: int, dtype: torch.dtype) -> tuple[int, ...]:
        x = torch.randn(rows, self.in_features, device=self.quantized.device, dtype=dtype)
        plans = triton_quant.candidates(self.table, self.out_features, self.in_features)
        plans = [p for p in plans if triton_quant.fits(p, rows)] or [_DEFAULT_PLAN]
        # A decode step reads each weight once, from HBM: before each timed call a write of more
        # than the L2 evicts the weight (the same cost for every plan, so the fastest stays fastest),
        # else a weight that fits the L2 would pick the plan fastest at L2 speed.
        try:
            flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=x.device)
        except torch.OutOfMemoryError:  # a full device: time the plans without it
            flush = torch.empty(0, dtype=torch.uint8, device=x.device)
        times = {}
        for plan in plans:
            try:
                times[plan] = _graph_time(lambda plan=plan: (flush.zero_(), self.decode(x, plan)))
            except Exception as e:  # a tiling this GPU / Triton cannot compile: the others remain
                log.warning(
                    "%s product plan %s failed here, skipped (%s: %s)", self.kind, plan, type(e).__name__, e
                )
        if not times:
            raise RuntimeError(
                f"no {self.kind} product compiled for a [{self.out_features}, {self.in_features}] weight"
            )
        return min(times, key=times.get)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.quantized.dequantize(dtype)

    def decode(self, rows: torch.Tensor, plan) -> torch.Tensor:
        return triton_quant.w8_product(rows, self.quantized, self.bias, plan, self.workspace)

    def prefill(self, rows: torch.Tensor) -> torch.Tensor:
        return triton_quant_prefill.w8_gemm(rows, self.quantized, self.bias)

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes


class Fp8Linear(_QuantLinear):
    """E4M3 weights with float32 scales per row (or per block of inputs)."""

    kind = "fp8"
    table = triton_quant.W8_CANDIDATES

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None):
        super().__init__(weight, bias)
        rows_scaled = weight.scale.shape[1] == 1
        n, k = weight.shape
        self.scaled_mm = rows_scaled and n % 16 == 0 and k % 16 == 0 and scaled_mm_supported(weight.device)
        if self.scaled_mm:
            self.weight_t = weight.data.t()  # column-major [K, N] (a view), as _scaled_mm wants it
            self.scale_b = weight.scale.float().view(1, n).contiguous()

    def prefill(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.scaled_mm or rows.dtype != torch.bfloat16:  # row-wise scaling returns bf16 only
            return super().prefill(rows)
        return self.scaled_product(*triton_quant.fp8_rows(rows))

    def scaled_product(self, xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """E4M3 activations [M, K] with float32 scales [M, 1] (``triton_quant.fp8_rows``, or a kernel
        that writes them fused with the op before, ``fp8_norm_rows`` / ``fp8_silu_mul_rows``) times
        the weight -> bf16 [M, N]; where ``self.scaled_mm`` holds (any M: only K and N need multiples
        of 16)."""
        out = torch._scaled_mm(
            xq, self.weight_t, scale, self.scale_b, out_dtype=torch.bfloat16, use_fast_accum=True
        )
        return out if self.bias is None else out + self.bias


class Int8CudaLinear(_QuantLinear):
    """int8 weights with a float32 scale per row (the bundle's int8: embeddings, lm_head of int4 ones)."""

    kind = "int8"
    table = triton_quant.W8_CANDIDATES


class Int4CudaLinear(_QuantLinear):
    """Group-32 asymmetric int4, repacked at load into the GPU layout of ``triton_quant``."""

    kind = "int4"
    table = triton_quant.INT4_CANDIDATES

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None):
        super().__init__(triton_quant.int4_gpu_layout(weight), bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return triton_quant.int4_dequantize(self.quantized, dtype)

    def decode(self, rows: torch.Tensor, plan) -> torch.Tensor:
        return triton_quant.int4_product(rows, self.quantized, self.bias, plan, self.workspace)

    def prefill(self, rows: torch.Tensor) -> torch.Tensor:
        return triton_quant_prefill.int4_gemm(rows, self.quantized, self.bias)


def runs(weight: QuantizedTensor, device: torch.device) -> bool:
    """Whether ``weight`` has a kernel on ``device`` (else the loader dequantizes it)."""
    cols = weight.shape[1]
    if cols % 16:
        return False
    if weight.format == "fp8":
        groups = weight.scale.shape[1] if weight.scale.dim() == 2 else 1
        size = cols // groups  # block scales: the kernels broadcast one per power-of-two group
        return fp8_supported(device) and (groups == 1 or (cols % groups == 0 and size & (size - 1) == 0))
    return weight.format == "int8" or (weight.format == "int4" and cols % triton_quant.SPAN == 0)


def make(weight: QuantizedTensor, bias: torch.Tensor | None):
    """The CUDA layer of a quantized weight for which ``runs`` holds."""
    if not runs(weight, weight.device):
        raise ValueError(f"no CUDA kernel for {weight.format} weights of shape {weight.shape}")
    if weight.format == "fp8":
        return Fp8Linear(weight, bias)
    if weight.format == "int8":
        return Int8CudaLinear(weight, bias)
    return Int4CudaLinear(weight, bias)
