"""Checkpoints published pre-quantized: recognise their scheme, turn their tensors into trtedge's.

A scheme is read from config.json's ``quantization_config`` (or ModelOpt's hf_quant_config.json):

- FP8: compressed-tensors ``float-quantized`` (per-tensor, per-channel or block scales: ``weight`` +
  ``weight_scale``), ModelOpt ``FP8`` (per-tensor ``weight_scale``), transformers' ``fp8`` with
  ``weight_block_size`` (``weight_scale_inv``). -> fp8 tensors, the scales carried over exactly.
- compressed-tensors ``pack-quantized`` symmetric int4 (W4A16): ``weight_packed`` + ``weight_scale``.
- AWQ (``version`` gemm) and GPTQ int4: ``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``). -> int4 with
  no loss but the rounding of ``-zero * scale`` to float16 where the groups are whole 32-input groups in
  order; otherwise (act-order ``g_idx``, groups under 32) dequantized and requantized to int4.
- ModelOpt ``NVFP4``: packed E2M1 ``weight`` + E4M3 ``weight_scale`` per 16 inputs + ``weight_scale_2``.
  -> fp8 with a scale per 16 inputs, exactly (every E2M1 value is an E4M3 value); no GPU here has FP4.

Activation and KV-cache scales (``input_scale``, ``k_scale`` ...) are dropped: weights run weight-only.
Any other scheme is refused when the checkpoint is resolved, with a message naming it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trtedge.runtime.artifacts.quantize import GROUP, QuantizedTensor, pack_int4, quantize_fp8, quantize_int4

log = logging.getLogger("trtedge")

SUPPORTED = (
    "fp8 (compressed-tensors float-quantized, ModelOpt FP8, fp8 weight_block_size), "
    "int4 (awq, gptq, compressed-tensors pack-quantized symmetric), ModelOpt NVFP4"
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8 c + AWQ_ORDER[i]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the FP4 codes 0..7; bit 3 is the sign
_DROPPED = (
    "input_scale",
    "k_scale",
    "v_scale",
    "kv_scale",
    "output_scale",
    "weight_global_scale",
    "weight_shape",
)


class QuantizationFormatError(ValueError):
    """A checkpoint's quantization scheme trtedge cannot serve; the message names it."""


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's weights are quantized: ``method`` fp8 | nvfp4 | awq | gptq, its producer
    (``source``), and the parameters the tensors need to be read."""

    method: str
    source: str
    group_size: int | None = None
    zero_offset: int = 0  # GPTQ's v1 format stores zero - 1
    scale_name: str = "weight_scale"

    @property
    def stored_format(self) -> str:
        """The trtedge format its weights become (``--weights auto`` keeps it)."""
        return "int4" if self.method in ("awq", "gptq", "packed-int4") else "fp8"

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def detect(config: dict, directory: Path | None = None) -> Scheme | None:
    """The scheme of a checkpoint with ``config`` (config.json) in ``directory``; None for float weights.
    Raises QuantizationFormatError for a scheme trtedge does not serve."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if qc is None and directory is not None and (directory / "hf_quant_config.json").is_file():
        modelopt = json.loads((directory / "hf_quant_config.json").read_text())
        qc = {"quant_method": "modelopt", **(modelopt.get("quantization") or {})}
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt":
        qc = {**qc, **(qc.get("quantization") or {})}  # some exports nest hf_quant_config.json's record
        algo = str(qc.get("quant_algo", "")).upper()
        if algo == "FP8":
            return Scheme("fp8", "modelopt")
        if algo == "NVFP4":
            return Scheme("nvfp4", "modelopt", group_size=int(qc.get("group_size", 16)))
        raise _refuse(f"ModelOpt quant_algo {algo or None!r}")
    if method == "fp8":
        return Scheme("fp8", "fp8", scale_name="weight_scale_inv")
    if method in ("awq", "gptq"):
        return _int4(method, qc)
    raise _refuse(f"quant_method {method or None!r}")


def _refuse(what: str) -> QuantizationFormatError:
    return QuantizationFormatError(
        f"quantization_config: {what} is not supported; trtedge loads {SUPPORTED} checkpoints"
    )


def _compressed_tensors(qc: dict) -> Scheme:
    fmt = qc.get("format")
    weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    fp8 = weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)
    if fmt == "float-quantized" and fp8:
        return Scheme("fp8", "compressed-tensors")
    int4 = weights and all(w.get("type") == "int" and w.get("num_bits") == 4 for w in weights)
    if fmt == "pack-quantized" and int4 and all(w.get("symmetric", True) for w in weights):
        return Scheme("packed-int4", "compressed-tensors")
    if fmt == "pack-quantized" and int4:
        raise _refuse("compressed-tensors pack-quantized with asymmetric int4 weights (zero points)")
    kinds = sorted({f"{w.get('type')}{w.get('num_bits')}" for w in weights})
    raise _refuse(f"compressed-tensors format {fmt!r} with weights {', '.join(kinds) or 'none'}")


def _int4(method: str, qc: dict) -> Scheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} with bits {bits!r} (only 4-bit)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is False:
            raise _refuse(
                f"awq version {version!r} zero_point {qc.get('zero_point', True)} (only gemm, zero_point)"
            )
        return Scheme("awq", "awq", group_size=group)
    offset = 0 if str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2" else 1
    return Scheme("gptq", "gptq", group_size=group, zero_offset=offset)


# ---- tensors ---------------------------------------------------------------------------------------
_PARTS = {
    "fp8": ("weight", "weight_scale"),
    "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales"),
    "packed-int4": ("weight_packed", "weight_scale"),
}
_ACT_ORDER = ("g_idx", "weight_g_idx")  # optional: the group of each input


def convert(tensors: Iterable[tuple[str, torch.Tensor]], scheme: Scheme) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each quantized layer's parts replaced by one ``<layer>.weight``
    (a QuantizedTensor); plain tensors pass through. A layer's parts may sit in different files."""
    parts = tuple(p if p != "weight_scale" else scheme.scale_name for p in _PARTS[scheme.method])
    buffered = set(parts) - {"weight"} | set(_ACT_ORDER)  # a "weight" only when its dtype is packed
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        quantized_weight = leaf == "weight" and _is_quantized_weight(tensor, scheme)
        if leaf not in buffered and not quantized_weight:
            yield name, tensor
            continue
        layer = pending.setdefault(prefix, {})
        layer[leaf] = tensor
        if all(p in layer for p in parts):
            del pending[prefix]
            yield prefix + ".weight", _layer(prefix, layer, scheme)
    for prefix, layer in pending.items():
        if set(layer) <= set(_ACT_ORDER):
            continue  # the layer was complete before its g_idx came (ordered groups need none)
        missing = [p for p in parts if p not in layer]
        raise QuantizationFormatError(f"quantized layer {prefix!r} is incomplete: no {', '.join(missing)}")


def _is_quantized_weight(tensor: torch.Tensor, scheme: Scheme) -> bool:
    if scheme.method == "nvfp4":
        return tensor.dtype == torch.uint8
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and scheme.method == "fp8"


def _layer(prefix: str, parts: dict[str, torch.Tensor], scheme: Scheme) -> QuantizedTensor:
    try:
        if scheme.method == "fp8":
            return fp8_from_scaled(parts["weight"], parts[scheme.scale_name])
        if scheme.method == "nvfp4":
            return fp8_from_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])
        if scheme.method == "awq":
            return int4_from_awq(parts["qweight"], parts["qzeros"], parts["scales"], scheme.group_size)
        if scheme.method == "packed-int4":
            return int4_from_packed(parts["weight_packed"], parts["weight_scale"], parts.get("weight_g_idx"))
        return int4_from_gptq(
            parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), scheme.zero_offset
        )
    except (RuntimeError, ValueError) as e:
        shapes = {k: tuple(v.shape) for k, v in parts.items()}
        raise QuantizationFormatError(
            f"{prefix}: cannot read its {scheme.method} tensors {shapes} ({e})"
        ) from None


def fp8_from_scaled(weight: torch.Tensor, scale: torch.Tensor) -> QuantizedTensor:
    """E4M3 ``weight`` [N, K] times ``scale``: one value (per tensor), [N] / [N, 1] (per row) or
    [ceil(N / bn), ceil(K / bk)] (blocks). Blocks that do not tile K evenly are requantized per row."""
    rows, cols = weight.shape
    scale = scale.float()
    if weight.dtype != torch.float8_e4m3fn:
        return quantize_fp8(weight.float() * _expand(scale, rows, cols))
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(rows, 1)
    elif scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1 and scale.shape[0] == rows):
        scale = scale.reshape(rows, 1)
    else:
        block_rows, block_cols = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
        if cols % block_cols:
            return quantize_fp8(weight.float() * _expand(scale, rows, cols))
        scale = scale.repeat_interleave(block_rows, dim=0)[:rows]
    return QuantizedTensor("fp8", weight.contiguous(), scale.contiguous())


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A scale of any of ``fp8_from_scaled``'s shapes as [rows, cols]."""
    if scale.numel() == 1 or scale.dim() == 1:
        return scale.reshape(-1, 1).expand(rows, cols) if scale.numel() > 1 else scale.reshape(1, 1)
    block_rows, block_cols = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def fp8_from_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> QuantizedTensor:
    """NVFP4: ``packed`` uint8 [N, K / 2] (element 2 i in the low nibble, 2 i + 1 in the high one),
    ``block_scale`` E4M3 [N, K / 16], ``global_scale`` one float32. Exact as fp8 with a scale per 16."""
    rows = packed.shape[0]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, -1).long()
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    values = table[codes]
    scale = block_scale.float()[:, : values.shape[1] // 16] * global_scale.float().reshape(())
    if values.shape[1] % scale.shape[1]:
        raise ValueError(f"{values.shape[1]} inputs do not split into {scale.shape[1]} scale blocks")
    return QuantizedTensor("fp8", values.to(torch.float8_e4m3fn).contiguous(), scale.contiguous())


def _unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 nibbles (nibble i at bits 4 i) -> the nibbles, 8 per word along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    if dim == 1:
        return nibbles.reshape(packed.shape[0], -1)
    return nibbles.permute(0, 2, 1).reshape(-1, packed.shape[1])


def int4_from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> QuantizedTensor:
    """AWQ gemm: ``qweight`` int32 [K, N / 8] and ``qzeros`` [K / group, N / 8] packed along N in
    AWQ_ORDER, ``scales`` [K / group, N]; ``w[k, n] = (q - z) * s`` of k's group."""
    reverse = torch.tensor([AWQ_ORDER.index(i) for i in range(8)])
    order = (torch.arange(qweight.shape[1] * 8) // 8) * 8 + reverse.repeat(qweight.shape[1])
    q = _unpack_int32(qweight, 1)[:, order]  # [K, N]
    zeros = _unpack_int32(qzeros, 1)[:, order]
    return _int4_groups(q.T, zeros.T, scales.T, None)


def int4_from_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, offset: int
) -> QuantizedTensor:
    """GPTQ: ``qweight`` int32 [K / 8, N] packed along K, ``qzeros`` [G, N / 8] packed along N (stored as
    zero - ``offset``), ``scales`` [G, N], ``g_idx`` [K] the group of each input (act-order)."""
    q = _unpack_int32(qweight, 0)  # [K, N]
    zeros = _unpack_int32(qzeros, 1)[:, : scales.shape[1]] + offset
    return _int4_groups(q.T, zeros.T, scales.T, g_idx)


def int4_from_packed(packed: torch.Tensor, scale: torch.Tensor, g_idx) -> QuantizedTensor:
    """compressed-tensors pack-quantized (symmetric): ``packed`` int32 [N, K / 8] along K (input 8 j + i
    at bits 4 i, stored as q + 8), ``scale`` [N, K / group]; ``w = q * s`` of the input's group."""
    codes = _unpack_int32(packed, 1)  # [N, K], q + 8
    zeros = torch.full(scale.shape, 8, dtype=torch.int32)
    return _int4_groups(codes, zeros, scale, g_idx)


def _int4_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx) -> QuantizedTensor:
    """q [N, K] codes, zeros / scales [N, G]: trtedge's group-32 int4, exactly where groups are ordered
    multiples of 32 inputs; else through the float weight."""
    rows, cols = q.shape
    groups = scales.shape[1]
    size = cols // groups
    ordered = g_idx is None or torch.equal(g_idx.long(), torch.arange(cols) // size)
    if ordered and cols % groups == 0 and size % GROUP == 0:
        s = scales.float().repeat_interleave(size // GROUP, dim=1)
        low = (-zeros.float() * scales.float()).repeat_interleave(size // GROUP, dim=1)
        return QuantizedTensor(
            "int4", pack_int4(q.to(torch.uint8)), s.half().contiguous(), low.half().contiguous()
        )
    index = g_idx.long() if g_idx is not None else torch.arange(cols) // size
    w = (q.float() - zeros.float()[:, index]) * scales.float()[:, index]
    if cols % GROUP:
        raise ValueError(f"int4 needs the input dimension to be a multiple of {GROUP}, got {cols}")
    log.info("int4 groups out of order (act-order g_idx or groups under %d inputs): requantized", GROUP)
    return quantize_int4(w)
