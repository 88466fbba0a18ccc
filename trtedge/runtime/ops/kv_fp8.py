"""The fp8 KV cache (``--kv-cache-dtype fp8``): E4M3 values with a float32 scale per head of each
token, stored beside them in one uint8 cache [num_blocks, block_size, num_kv_heads, head_dim + 4].
The CPU's int8 cache (``--kv-cache-dtype int8``) has the same layout in an int8 tensor: symmetric
int8 values (the row's largest magnitude maps to 127, rounded to nearest even) and the scale.

Bytes ``0 .. head_dim`` of a (slot, head) row are the head's key (or value) in E4M3 and the last
four its scale, so that ``x ~ e4m3 * scale``; the scale maps the row's largest magnitude to 448.
A per-row scale needs no calibration and no checkpoint scales, keeps outlier heads in range, and
costs 4 bytes per ``head_dim`` (3% at 128). The attention kernels multiply a key's scores by its
scale and a value's weights by its own; this module holds the layout and its torch reference
(the write every path uses outside the fused decode kernel, and the read of the reference
attention).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INT8_MAX = 127.0
SCALE_BYTES = 4  # a float32 after each row's values
# fp16 and int8: the CPU's pools (its native kernels convert each row)
DTYPES = ("auto", "fp8", "fp16", "int8")
SCALED = ("fp8", "int8")  # rows of values and a float32 scale


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def is_scaled(cache: torch.Tensor) -> bool:
    """Rows of 8-bit values and their scale (fp8 or int8)."""
    return is_fp8(cache) or is_int8(cache)


def row_width(head_dim: int) -> int:
    """Bytes of one (slot, head) row of an fp8 or int8 cache."""
    return head_dim + SCALE_BYTES


def head_dim(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_scaled(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D + 4]: E4M3 values and their float32 scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    values = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([values, scale.view(torch.uint8)], dim=-1)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> int8 [..., D + 4]: int8 values and their float32 scale (as the native kernels write)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / INT8_MAX
    values = (xf / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 (fp8) or int8 [..., D + 4] -> [..., D] in ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    values = (
        rows[..., :d].float()
        if is_int8(rows)
        else rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    )
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` [T, Hkv, D] into cache slots ``slots`` [T] (any cache dtype)."""
    flat = cache.view(-1, *cache.shape[2:])
    if is_fp8(cache):
        rows = quantize(x)
    elif is_int8(cache):
        rows = quantize_int8(x)
    else:
        rows = x.to(cache.dtype)
    flat.index_copy_(0, slots, rows)


def read(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows [..., D] in ``dtype`` (the reference attention's keys and values)."""
    return dequantize(cache, dtype) if is_scaled(cache) else cache.to(dtype)  # fp16 on the CPU: float32


def unsupported(device: torch.device) -> str | None:
    """Why ``device`` cannot hold an fp8 KV cache, or None where it can."""
    from trtedge.runtime.ops.triton_attention import available

    if device.type != "cuda":
        return f"needs a CUDA GPU; the {device.type}'s KV cache is the model's dtype, fp16 or int8"
    if not available():
        return "needs Triton (the attention kernels read it)"
    if torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"needs compute capability 8.9 or later for E4M3 (this GPU has {major}.{minor})"
    return None


def cache_shape(shape: tuple[int, ...], kv_cache_dtype: str) -> tuple[int, ...]:
    """The pool shape [..., Hkv, D] of ``kv_cache_dtype`` (fp8, int8: each row D + 4 bytes)."""
    if kv_cache_dtype in SCALED:
        return (*shape[:-1], row_width(shape[-1]))
    return tuple(shape)
