"""Tiny pre-quantized checkpoints, written here from a tiny float one by reference quantizers that
follow each format's published layout (independent of trtedge's readers), with the float weights
they stand for (the dequantized reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _is_linear(name: str, linears=LINEARS) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in linears


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[..., 8 m] ints 0..15 -> [..., m] int32, element i of each 8 at bits 4 i."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    word = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


# ---- fp8 ---------------------------------------------------------------------------------------------
def fp8_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    q = (w / scale).to(E4M3)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor([0.02])}, q.float() * scale


def fp8_tensor(w):
    scale = w.abs().max() / 448
    q = (w / scale).to(E4M3)
    return {
        "weight": q,
        "weight_scale": scale.reshape(()),
        "input_scale": torch.tensor(0.02),
    }, q.float() * scale


def _fp8_blocks(w, block, scale_name):
    n, k = w.shape
    blocks = w.reshape(n // block, block, k // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448  # [n / block, k / block]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / full).to(E4M3)
    return {"weight": q, scale_name: scale}, q.float() * full


def fp8_block(w):
    return _fp8_blocks(w, 32, "weight_scale")


def fp8_block_inv(w):
    return _fp8_blocks(w, 32, "weight_scale_inv")


# ---- NVFP4 -------------------------------------------------------------------------------------------
def nvfp4(w):
    n, k = w.shape
    blocks = w.reshape(n, k // 16, 16)
    wanted = blocks.abs().amax(dim=-1) / 6.0
    global_scale = wanted.max() / 448
    block_scale = (wanted / global_scale).to(E4M3)
    scale = block_scale.float() * global_scale
    scaled = blocks / scale.clamp(min=1e-12)[..., None]
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(dim=-1)  # nearest magnitude
    code = code + 8 * (scaled < 0)
    values = torch.cat([E2M1, -E2M1])[code]
    flat = code.reshape(n, k).to(torch.uint8)
    packed = flat[:, 0::2] | (flat[:, 1::2] << 4)  # element 2 i low, 2 i + 1 high
    parts = {
        "weight": packed,
        "weight_scale": block_scale,
        "weight_scale_2": global_scale.reshape(()),
        "input_scale": torch.tensor(0.01),
    }
    return parts, (values * scale[..., None]).reshape(n, k)


# ---- AWQ / GPTQ --------------------------------------------------------------------------------------
def _int4_groups(w, group, symmetric=False):
    """Codes [N, K], zeros and fp16 scales [N, K / group]."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if symmetric:
        scale = (g.abs().amax(dim=-1) / 7.5).half()
        zero = torch.full(scale.shape, 8)
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15).half()
        zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15).long()
    ref = (q - zero[..., None]).float() * scale.float()[..., None]
    return q.reshape(n, k), zero, scale, ref.reshape(n, k)


def awq(w, group=64):
    q, zero, scale, ref = _int4_groups(w, group)
    order = torch.tensor(AWQ_ORDER)

    def pack_columns(t):  # [rows, N] -> [rows, N / 8], column 8 c + AWQ_ORDER[i] at nibble i
        return _pack_nibbles(t.reshape(t.shape[0], -1, 8)[..., order].reshape(t.shape[0], -1))

    parts = {"qweight": pack_columns(q.T), "qzeros": pack_columns(zero.T), "scales": scale.T.contiguous()}
    return parts, ref


def gptq(w, group=32, act_order=False):
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if act_order:  # inputs assigned to groups out of order, as act-order leaves them
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(3))]
    q = torch.empty(n, k, dtype=torch.long)
    ref = torch.empty(n, k)
    zeros, scales = [], []
    for gi in range(k // group):
        cols = (g_idx == gi).nonzero().flatten()
        qg, zg, sg, rg = _int4_groups(w[:, cols], group, symmetric=True)
        q[:, cols], ref[:, cols] = qg, rg
        zeros.append(zg[:, 0])
        scales.append(sg[:, 0])
    zero, scale = torch.stack(zeros, 1), torch.stack(scales, 1)  # [N, G]
    parts = {
        "qweight": _pack_nibbles(q.T.reshape(k // 8, 8, n).permute(0, 2, 1)).squeeze(-1),  # along K
        "qzeros": _pack_nibbles(zero.T - 1),  # v1 stores zero - 1, packed along N
        "scales": scale.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return parts, ref


def w4a16(w, group=32):
    """compressed-tensors pack-quantized, symmetric: signed codes stored as q + 8, packed along K."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scale = (g.abs().amax(dim=-1) / 7.5).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).long()
    ref = (q.float() * scale.float()[..., None]).reshape(n, k)
    parts = {
        "weight_packed": _pack_nibbles(q.reshape(n, k) + 8),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    return parts, ref


FORMATS = {
    "compressed-tensors-fp8-channel": (fp8_channel, "channel"),
    "compressed-tensors-fp8-block": (fp8_block, "block"),
    "modelopt-fp8": (fp8_tensor, None),
    "fp8-block": (fp8_block_inv, None),
    "modelopt-nvfp4": (nvfp4, None),
    "compressed-tensors-w4a16": (w4a16, "group"),
    "awq": (awq, None),
    "gptq": (gptq, None),
    "gptq-act-order": (lambda w: gptq(w, act_order=True), None),
}


def _config(fmt: str) -> dict | None:
    if fmt == "compressed-tensors-w4a16":
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
        groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}
    if fmt.startswith("compressed-tensors"):
        strategy = FORMATS[fmt][1]
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
        if strategy == "block":
            weights["block_structure"] = [32, 32]
        groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "dynamic"}
    if fmt == "modelopt-nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": fmt != "gptq"}
    return None  # ModelOpt FP8: hf_quant_config.json only


def write_prequantized(
    src: Path, dst: Path, fmt: str, linears: tuple[str, ...] = LINEARS
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Copy the tiny float checkpoint ``src`` to ``dst`` with its decoder linears (the weights named
    ``<one of linears>.weight``) quantized in ``fmt``; returns (dst, name -> the float weight each
    quantized layer stands for)."""
    quantizer = FORMATS[fmt][0]
    dst.mkdir(parents=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    out, reference = {}, {}
    for name, t in tensors.items():
        if not _is_linear(name, linears):
            out[name] = t
            continue
        parts, ref = quantizer(t.float())
        prefix = name.removesuffix(".weight")
        out.update({f"{prefix}.{leaf}": v.contiguous() for leaf, v in parts.items()})
        reference[name] = ref
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    qc = _config(fmt)
    if qc is None:
        producer = {"name": "modelopt", "version": "0.0"}
        quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quant}))
    else:
        config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst, reference


def write_dequantized(src: Path, dst: Path, reference: dict[str, torch.Tensor]) -> Path:
    """``src`` with its linears replaced by the dequantized ``reference`` (the float model to match)."""
    shutil.copytree(src, dst)
    file = next(dst.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors.update({name: ref.to(tensors[name].dtype) for name, ref in reference.items()})
    save_file(tensors, str(file))
    return dst
