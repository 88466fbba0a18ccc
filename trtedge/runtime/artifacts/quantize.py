"""Weight-only quantized tensors as bundles store them, with their dequantize reference.

int8: symmetric per output row, ``w = scale[n] * q`` (q in -127..127, scale float32).
int4: asymmetric per group of 32 along the input dimension, ``w = scale * q + min`` (q in 0..15,
scale and min float16), the class of llama.cpp's Q4_1; Q4_0 (``d * (q - 8)``) and Q4_1 blocks map
onto it without loss. Packing, per row, in the order the native kernel reads: each block of 16
groups (512 inputs) is 256 bytes where byte ``32 c + 2 l + e`` (c < 8, l < 16, e < 2) holds input
``4 c + e`` of the block's group l in its low nibble and input ``4 c + 2 + e`` in its high nibble,
so that one 16-lane integer dot product covers 16 groups at once. The groups after the last whole
block go in spans of two (32 bytes, byte j: inputs j and 32 + j of the span) and an odd last group
is 16 bytes (byte j: inputs j and 16 + j).
fp8: E4M3 values with float32 scales, ``w = scale[n, k // (cols / groups)] * q``: one scale per row
(``--weights fp8``, ModelOpt and per-channel compressed-tensors checkpoints) or per block of inputs
(128-wide blocks of block-scaled checkpoints, 16-wide ones of NVFP4 checkpoints carried over).
gguf: a GGUF file's Q8_0, Q4_K, Q5_K and Q6_K blocks as the file holds them (``data``: the rows'
block bytes, flat uint8), the rows in segments of one type each (``scale``: int64 [segments, 5] =
rows, ggml type, cols, bytes per row, byte offset), so a fused q/k/v may hold Q4_K and Q6_K rows.
The native CPU kernels (``ops/cpu_gguf.c``) read the blocks directly: no error beyond the file's own.
The GPU runs int8 / int4 / fp8 tensors through the kernels of ``ops.quant_linear``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from trtedge.runtime.multimodal import is_encoder_tensor

GROUP = 32
FORMATS = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # the largest finite E4M3 value
# What a bundle's manifest records about its quantized tensors.
QUANTIZATION_LAYOUT = {
    "int8": {"granularity": "row", "symmetric": True, "scale": "float32"},
    "int4": {"group_size": GROUP, "symmetric": False, "scale": "float16", "min": "float16"},
    "fp8": {"dtype": "float8_e4m3fn", "scale": "float32", "granularity": "row or input block"},
    "gguf": {"blocks": "as the GGUF file holds them", "types": ["Q8_0", "Q4_K", "Q5_K", "Q6_K"]},
}
# ggml type ids of the blocks a "gguf" tensor keeps, and (inputs, bytes) per block
GGUF_BLOCKS = {"Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
_SEG_ROWS, _SEG_TYPE, _SEG_COLS, _SEG_ROW_BYTES, _SEG_OFFSET = range(5)
# Suffixes of the stored tensors: "<name>.int4", "<name>.int4_scale", ...
_PARTS = {
    "int8": ("int8", "int8_scale"),
    "int4": ("int4", "int4_scale", "int4_min"),
    "fp8": ("fp8", "fp8_scale"),
    "gguf": ("gguf", "gguf_segments"),
}


@dataclass
class QuantizedTensor:
    """A quantized 2-D weight [rows, cols]: ``data`` plus ``scale`` (and ``min`` for int4)."""

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.format == "gguf":
            segs = self.segments()
            return sum(seg[_SEG_ROWS] for seg in segs), segs[0][_SEG_COLS]
        rows, width = self.data.shape
        return (rows, width * 2) if self.format == "int4" else (rows, width)

    def segments(self) -> list[list[int]]:
        """A "gguf" tensor's segment rows (``scale``) as Python ints, read once: an embedding lookup and
        the lm_head ask for them every decode step, and each read of the tensor costs tens of us."""
        cached = self.__dict__.get("_segments")
        if cached is None or cached[0] is not self.scale:
            cached = self.__dict__["_segments"] = (self.scale, self.scale.tolist())
        return cached[1]

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scale, self.min)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.format == "int8":
            return (self.data.float() * self.scale.float().reshape(-1, 1)).to(dtype)
        if self.format == "gguf":
            return gguf_dequantize(self).to(dtype)
        if self.format == "fp8":
            rows, cols = self.shape
            scale = self.scale.float().view(rows, -1)
            w = self.data.float().view(rows, scale.shape[1], -1) * scale[..., None]
            return w.view(rows, cols).to(dtype)
        q = unpack_int4(self.data).float().view(self.shape[0], -1, GROUP)
        w = q * self.scale.float()[..., None] + self.min.float()[..., None]
        return w.view(self.shape).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` (an embedding lookup), float32."""
        if self.format == "gguf":
            if ids.numel() <= 8 and self.data.device.type == "cpu":  # a decode step's lookup
                out = _gguf_few_rows(self, ids.reshape(-1).tolist())
                if out is not None:
                    return out.view(*ids.shape, self.shape[1])
            return self.select_rows(ids.reshape(-1)).dequantize().view(*ids.shape, self.shape[1])
        part = QuantizedTensor(
            self.format,
            self.data[ids.reshape(-1)],
            self.scale[ids.reshape(-1)],
            None if self.min is None else self.min[ids.reshape(-1)],
        )
        return part.dequantize().view(*ids.shape, self.shape[1])

    def to(self, device: torch.device) -> QuantizedTensor:
        parts = (self.data, self.scale, self.min)
        moved = [None if t is None else t.to(device, non_blocking=True) for t in parts]
        return QuantizedTensor(self.format, *moved)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def select_rows(self, index: torch.Tensor) -> QuantizedTensor:
        if self.format == "gguf":
            return _gguf_select_rows(self, index)
        return QuantizedTensor(
            self.format, self.data[index], self.scale[index], None if self.min is None else self.min[index]
        )

    def row_slice(self, lo: int | None, hi: int | None) -> QuantizedTensor:
        """Rows lo .. hi - 1, as ``[lo:hi]`` (views of the bytes, except a gguf tensor's: copied)."""
        if self.format == "gguf":
            lo, hi, _ = slice(lo, hi).indices(self.shape[0])
            return _gguf_row_slice(self, lo, hi)
        return QuantizedTensor(
            self.format, self.data[lo:hi], self.scale[lo:hi], None if self.min is None else self.min[lo:hi]
        )

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        tensors = (self.data, self.scale, self.min)
        return {f"{name}.{suffix}": t.contiguous() for suffix, t in zip(_PARTS[self.format], tensors)}

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        first = parts[0]
        if any(p.format != first.format for p in parts):
            raise ValueError("cannot concatenate weights quantized in different formats")
        if first.format == "gguf":
            return _gguf_cat(parts)
        mins = None if first.min is None else torch.cat([p.min for p in parts])
        return QuantizedTensor(
            first.format, torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), mins
        )


def quantized_name(stored: str) -> tuple[str, str, str] | None:
    """'x.weight.int4_scale' -> ('x.weight', 'int4', 'int4_scale'); None for a plain tensor."""
    base, _, suffix = stored.rpartition(".")
    for fmt, parts in _PARTS.items():
        if suffix in parts:
            return base, fmt, suffix
    return None


def gather(tensors: dict[str, torch.Tensor]):
    """Group stored tensors back into plain tensors and QuantizedTensors, by their plain name."""
    plain: dict[str, object] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = quantized_name(name)
        if parsed is None:
            plain[name] = tensor
            continue
        base, fmt, suffix = parsed
        pending.setdefault(base, {"format": fmt})[suffix] = tensor
    for base, parts in pending.items():
        fmt = parts["format"]
        names = _PARTS[fmt]
        if any(n not in parts for n in names):
            raise ValueError(f"quantized tensor {base!r} is incomplete (needs {', '.join(names)})")
        plain[base] = QuantizedTensor(fmt, *(parts[n] for n in names))
    return plain


# ---- int8 ------------------------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric per-row int8 with a float32 scale per row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", q.contiguous(), scale.contiguous())


# ---- int4 ------------------------------------------------------------------------------------------
def int4_supported(shape) -> bool:
    return len(shape) == 2 and shape[1] % GROUP == 0


BLOCK_GROUPS = 16


@functools.cache
def _span_order(cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(low input, high input) of each packed byte of one row, as flat index arrays."""
    lows, highs = [], []
    block = BLOCK_GROUPS * GROUP
    c, lane, e = np.meshgrid(np.arange(8), np.arange(BLOCK_GROUPS), np.arange(2), indexing="ij")
    within = (lane * GROUP + 4 * c + e).reshape(-1)  # byte 32 c + 2 l + e
    whole = cols // block * block
    for start in range(0, whole, block):
        lows.append(start + within)
        highs.append(start + within + 2)
    for start in range(whole, cols, 2 * GROUP):
        half = min(2 * GROUP, cols - start) // 2
        lows.append(np.arange(start, start + half))
        highs.append(np.arange(start + half, start + 2 * half))
    return np.concatenate(lows), np.concatenate(highs)


def _order_on(cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = _span_order(cols)
    return torch.from_numpy(low).to(device), torch.from_numpy(high).to(device)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [rows, cols] -> packed uint8 [rows, cols / 2] in the kernel layout."""
    low, high = _order_on(q.shape[1], q.device)
    q = q.to(torch.uint8)
    return (q[:, low] | (q[:, high] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    rows, width = packed.shape
    low, high = _order_on(width * 2, packed.device)
    q = torch.empty(rows, width * 2, dtype=torch.uint8, device=packed.device)
    q[:, low] = packed & 0x0F
    q[:, high] = packed >> 4
    return q


def quantize_int4(weight: torch.Tensor) -> QuantizedTensor:
    """Asymmetric group-32 int4 (min-max per group); scale and min rounded to float16 first."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"int4 needs the input dimension to be a multiple of {GROUP}, got {cols}")
    w = weight.float().view(rows, cols // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).to(torch.float16)
    low = lo.to(torch.float16)
    s = scale.float().clamp(min=1e-30)[..., None]
    q = torch.round((w - low.float()[..., None]) / s).clamp(0, 15).to(torch.uint8)
    return QuantizedTensor("int4", pack_int4(q.view(rows, cols)), scale.contiguous(), low.contiguous())


def int4_from_gguf_blocks(blocks: np.ndarray, kind: str, rows: int, cols: int) -> QuantizedTensor:
    """Q4_0 / Q4_1 block bytes [rows, cols / 32 * block] -> int4 with no loss of information."""
    groups = cols // GROUP
    raw = np.ascontiguousarray(blocks).reshape(rows, groups, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0]
        qs = raw[..., 4:20]
    elif kind == "Q4_0":
        m = (d.astype(np.float32) * -8.0).astype(np.float16)  # times a power of two: exact
        qs = raw[..., 2:18]
    else:
        raise ValueError(f"no direct int4 mapping for GGUF type {kind}")
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # Q4 block: j and 16 + j
    return QuantizedTensor(
        "int4", pack_int4(torch.from_numpy(q)), torch.from_numpy(d.copy()), torch.from_numpy(m.copy())
    )


# ---- gguf blocks -----------------------------------------------------------------------------------
def gguf_blocks(blocks: np.ndarray | torch.Tensor, kind: str, rows: int, cols: int) -> QuantizedTensor:
    """A GGUF tensor's block bytes [rows, cols / block inputs * block bytes], kept as they are."""
    type_id, per, size = GGUF_BLOCKS[kind]
    if cols % per:
        raise ValueError(f"{kind} rows need a multiple of {per} inputs, got {cols}")
    data = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(-1)  # a copy: the file is read-only
    segments = torch.tensor([[rows, type_id, cols, cols // per * size, 0]], dtype=torch.int64)
    return QuantizedTensor("gguf", data.contiguous(), segments)


def _gguf_segments(parts: list[tuple[int, int, int, int, torch.Tensor]]) -> QuantizedTensor:
    """(rows, type, cols, row bytes, bytes) runs -> one tensor, neighbouring runs of a type merged."""
    segs: list[list[int]] = []
    offset = 0
    for rows, type_id, cols, row_bytes, data in parts:
        if segs and segs[-1][_SEG_TYPE] == type_id and segs[-1][_SEG_ROW_BYTES] == row_bytes:
            segs[-1][_SEG_ROWS] += rows
        else:
            segs.append([rows, type_id, cols, row_bytes, offset])
        offset += data.numel()
    data = torch.cat([p[4].reshape(-1) for p in parts])
    out = QuantizedTensor("gguf", data, torch.tensor(segs, dtype=torch.int64))
    out.__dict__["_segments"] = (out.scale, segs)
    return out


def _gguf_runs(q: QuantizedTensor):
    for rows, type_id, cols, row_bytes, offset in q.segments():
        yield rows, type_id, cols, row_bytes, q.data[offset : offset + rows * row_bytes].view(rows, row_bytes)


def _gguf_cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
    return _gguf_segments([run for p in parts for run in _gguf_runs(p)])


def _gguf_few_rows(q: QuantizedTensor, ids: list[int]) -> torch.Tensor | None:
    """Rows ``ids`` of a one-segment "gguf" tensor, dequantized by the native kernel straight from the
    tensor's bytes (no gathered copy; tens of us less than ``select_rows`` a lookup); None without the
    kernels or with several segments."""
    from trtedge.runtime.ops import cpu_kernels

    segs = q.segments()
    lib = cpu_kernels.load()
    if lib is None or len(segs) != 1:
        return None
    rows, type_id, cols, row_bytes, offset = segs[0]
    one = q.__dict__.get("_one_row")
    if one is None:
        one = q.__dict__["_one_row"] = torch.tensor([[1, type_id, cols, row_bytes, 0]], dtype=torch.int64)
    out = torch.empty(len(ids), cols, dtype=torch.float32)
    base = q.data.data_ptr() + offset
    for i, n in enumerate(ids):
        if not 0 <= n < rows:
            raise IndexError(f"index {n} is out of bounds for dimension 0 with size {rows}")
        lib.gguf_dequantize(base + n * row_bytes, one.data_ptr(), 1, out.data_ptr() + 4 * i * cols, 1, cols)
    return out


def _gguf_select_rows(q: QuantizedTensor, index: torch.Tensor) -> QuantizedTensor:
    index = index.reshape(-1)
    runs = list(_gguf_runs(q))
    if len(runs) == 1:  # one type (an embedding lookup, q/k rows unpermuted)
        rows, type_id, cols, row_bytes, data = runs[0]
        return _gguf_segments([(index.numel(), type_id, cols, row_bytes, data[index])])
    bounds, first = [], 0
    for run in runs:
        bounds.append((first, run))
        first += run[0]
    picked = []  # one run per row, merged by type
    for n in index.tolist():
        start, (rows, type_id, cols, row_bytes, data) = next((b, r) for b, r in bounds if n < b + r[0])
        picked.append((1, type_id, cols, row_bytes, data[n - start]))
    return _gguf_segments(picked)


def _gguf_row_slice(q: QuantizedTensor, lo: int, hi: int) -> QuantizedTensor:
    parts, first = [], 0
    for rows, type_id, cols, row_bytes, data in _gguf_runs(q):
        a, b = max(lo, first), min(hi, first + rows)
        if a < b:
            parts.append((b - a, type_id, cols, row_bytes, data[a - first : b - first]))
        first += rows
    return _gguf_segments(parts)


def gguf_dequantize(q: QuantizedTensor) -> torch.Tensor:
    """float32 [rows, cols]: the native dequantization, or gguf's numpy one without a compiler."""
    from trtedge.runtime.ops import cpu_kernels

    rows, cols = q.shape
    lib = cpu_kernels.load() if q.data.device.type == "cpu" else None
    if lib is not None:
        return cpu_kernels.gguf_dequantize(lib, q)
    import gguf

    names = {type_id: kind for kind, (type_id, _, _) in GGUF_BLOCKS.items()}
    out = []
    for _, type_id, _, _, data in _gguf_runs(q):
        kind = gguf.GGMLQuantizationType[names[type_id]]
        out.append(torch.from_numpy(gguf.quants.dequantize(data.cpu().numpy(), kind)).reshape(-1, cols))
    return torch.cat(out).float()


# ---- fp8 -------------------------------------------------------------------------------------------
def quantize_fp8(weight: torch.Tensor) -> QuantizedTensor:
    """E4M3 with a float32 scale per row (the row's largest magnitude maps to 448)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedTensor("fp8", q.contiguous(), scale[:, None].contiguous())


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedTensor:
    if fmt == "fp8":
        return quantize_fp8(weight)
    return quantize_int4(weight) if fmt == "int4" else quantize_int8(weight)


# ---- which tensors are quantized, and how -----------------------------------------------------------
_INT4_SOURCES = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")
GGUF_KEPT = tuple(GGUF_BLOCKS)  # --weights auto keeps these blocks as the file holds them
_FLOAT_SOURCES = ("F32", "F16", "BF16", "F64")
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def target_format(name: str, shape, mode: str, source_type: str | None = None) -> str | None:
    """The format tensor ``name`` is stored and run in for weights ``mode``; None keeps it float.

    int4 covers the decoder's linear layers; embeddings and lm_head (and any input dimension that is
    not a multiple of 32) take int8, as llama.cpp's Q4 files keep their token embedding in Q8_0.
    auto follows a GGUF tensor's own class: Q8_0, Q4_K, Q5_K and Q6_K stay as they are ("gguf"),
    Q4_0 / Q4_1 (and other 4-bit types) -> int4, other quantized types -> int8.
    fp8 covers every matrix, embeddings and lm_head included (E4M3 rows keep 3 mantissa bits).
    """
    if len(shape) != 2 or not name.endswith(".weight") or is_encoder_tensor(name):
        return None  # media encoders stay float
    if name.endswith("embed_tokens_per_layer.weight"):
        return None  # a PLE table is gathered by rows, never multiplied, and may be mapped from its file
    if mode == "auto":
        if not source_type or source_type in _FLOAT_SOURCES:
            return None
        if source_type in GGUF_KEPT:
            return "gguf"
        mode = "int4" if source_type in _INT4_SOURCES else "int8"
    if mode == "int4":
        return "int4" if name not in _EMBEDDINGS and int4_supported(shape) else "int8"
    return mode if mode in ("int8", "fp8") else None
