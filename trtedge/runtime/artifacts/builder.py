"""`build --components ...`: turn a checkpoint into a bundle directory (weights, tokenizer, template).

Weights are written once in the format the profile's ``weights`` asks for (``runtime.quantize``):
int8 / int4 / fp8 tensors as their packed parts (a pre-quantized checkpoint's layers, converted by
``prequantized``, keep their format under ``auto``), GGUF Q4_0/Q4_1 blocks carried over to int4 without
dequantizing, float tensors in the profile dtype (GGUF: float32 unless told). HF safetensors that
need no conversion are not copied: the manifest lists them with their digests and loading verifies
them. Fused projection layouts are still made by the model at load time. A converted weight set is
hard-linked from another bundle of the same checkpoint, dtype and weights when one exists, so
profiles that differ only in lengths or batch size share one copy on disk."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trtedge._version import __version__
from trtedge.runtime.artifacts.bundle import (
    SPEECH_COMPONENTS,
    TEXT_FILES,
    BuildProfile,
    Cache,
    digest_json,
    now_iso,
)
from trtedge.runtime.artifacts.bundle import fingerprint as checkpoint_fingerprint
from trtedge.runtime.artifacts.quantize import QUANTIZATION_LAYOUT, QuantizedTensor, quantize, target_format

log = logging.getLogger("trtedge")

Progress = Callable[[str, int, "int | None"], None]

_SHARD_BYTES = 2 * 2**30
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_FLOAT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def build_bundle(
    checkpoint,
    profile: BuildProfile,
    out_dir: Path,
    *,
    fingerprint: tuple[str, dict] | None = None,
    draft=None,
    cache: Cache | None = None,
    progress: Progress | None = None,
) -> dict:
    """Write the bundle of ``checkpoint`` for ``profile`` into ``out_dir``; manifest.json comes last."""
    start = time.perf_counter()
    out_dir.mkdir(parents=True)
    components = {"llm": _build_component(checkpoint, profile, out_dir, fingerprint, cache, progress)}
    if "draft" in profile.components and draft is not None:
        components["draft"] = _build_component(draft, profile, out_dir / "draft", None, cache, progress)
    if "vision" in profile.components:
        components["vision"] = _build_component(
            checkpoint, profile, out_dir / "vision", fingerprint, cache, progress, part="vision"
        )
    for name in SPEECH_COMPONENTS:
        if name in profile.components:
            components[name] = _build_component(
                checkpoint, profile, out_dir / name, fingerprint, cache, progress, part=name
            )
    _test_delay()
    manifest = {
        "layout_version": profile.layout_version,
        "model": checkpoint.name,
        "profile": {**profile.key_fields(), "draft_model": profile.draft_model},
        "components": components,
        "versions": {"trtedge": __version__, "torch": torch.__version__.split("+")[0]},
        "created": now_iso(),
        "build_seconds": round(time.perf_counter() - start, 3),
    }
    _write(out_dir / "manifest.json", json.dumps(manifest, indent=1).encode())
    return manifest


def _build_component(
    checkpoint, profile, out_dir: Path, fp, cache, progress, part: str | None = None
) -> dict:
    """The LLM (its text model's tensors) or, with ``part``, the vision encoder's tensors or a speech
    component's (float)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fp = fp or checkpoint_fingerprint(checkpoint.path)
    if part is None:
        _write_tokenizer(checkpoint, out_dir)
    _write(out_dir / "config.json", json.dumps(checkpoint.config, indent=1).encode())
    section = {
        "model": checkpoint.name,
        "checkpoint": {
            "path": str(Path(checkpoint.path).resolve()),
            "kind": checkpoint.kind,
            "fingerprint": fp[0],
            "files": fp[1],
        },
        "config": checkpoint.config,
        "quantization": checkpoint.quantization,
    }
    scheme = checkpoint.scheme
    if scheme is not None and part is None:
        section["prequantized"] = scheme.record()
    mode = "float" if part else profile.weights
    dtype = _stored_dtype(checkpoint, _WEIGHT_DTYPES.get(profile.weights, profile.dtype))
    quantizes = mode in ("int8", "int4", "fp8") or (mode == "auto" and checkpoint.kind == "gguf")
    if scheme is not None:  # its own files hold packed parts the model cannot read: always converted
        quantizes = True
        dtype = dtype or _FLOAT_DTYPES.get(str(checkpoint.config.get("torch_dtype")), "bfloat16")
    if dtype is None and not quantizes:
        weights = {name: digest for name, digest in fp[1].items() if name.endswith(".safetensors")}
        section["weights"] = {"externalized": True, "files": weights, "dtype": "checkpoint"}
        return section
    key = {"checkpoint": fp[0], "dtype": dtype, "weights": mode, "layout": profile.layout_version}
    if part:
        key["component"] = part
    weights_key = digest_json(key)[:24]
    files = _link_weights(cache, weights_key, out_dir) if cache else None
    counts = None
    if files is None:
        files, counts = _write_shards(checkpoint, out_dir, dtype, mode, progress, part)
    section["weights"] = {
        "externalized": False,
        "files": files,
        "dtype": dtype or "checkpoint",
        "key": weights_key,
        "quantization": {"mode": mode, **QUANTIZATION_LAYOUT, "tensors": counts},
    }
    return section


def _stored_dtype(checkpoint, dtype: str) -> str | None:
    """The dtype to write float weights in, or None to keep the checkpoint's own (HF safetensors)."""
    if checkpoint.kind == "gguf":
        return dtype if dtype in _TORCH_DTYPES else "float32"
    if dtype == "auto" or _safetensors_dtypes(checkpoint.path) <= {dtype}:
        return None
    return dtype


def _safetensors_dtypes(path: Path) -> set[str]:
    from trtedge.runtime.artifacts.checkpoint import safetensors_files

    found = set()
    for file in safetensors_files(Path(path)):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        found.update(_ST_DTYPES.get(v["dtype"], v["dtype"]) for k, v in header.items() if k != "__metadata__")
    return found


def _write_tokenizer(checkpoint, out_dir: Path) -> None:
    if checkpoint.kind == "gguf":
        t = checkpoint.tokenizer_files
        _write(out_dir / "tokenizer.json", t["tokenizer_json"].encode())
        _write(out_dir / "tokenizer_config.json", json.dumps(t["tokenizer_config"]).encode())
        _write(out_dir / "generation_config.json", json.dumps(t["generation_config"]).encode())
        return
    src = Path(checkpoint.path)
    names = [n for n in TEXT_FILES if n not in ("config.json", "model.safetensors.index.json")]
    names += [p.relative_to(src).as_posix() for p in sorted(src.glob("additional_chat_templates/*.jinja"))]
    for name in names:
        if (src / name).is_file():
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            _write(out_dir / name, (src / name).read_bytes())


def _link_weights(cache: Cache, weights_key: str, out_dir: Path) -> list[str] | None:
    """Hard-link the weights another bundle already converted from the same checkpoint and dtype."""
    for entry in cache.entries():
        if entry.outdated:
            continue
        try:
            manifest = json.loads((entry.path / "manifest.json").read_text())
        except (OSError, ValueError):
            continue  # evicted meanwhile
        for name, section in manifest.get("components", {}).items():
            weights = section.get("weights", {})
            if weights.get("key") != weights_key:
                continue
            src_dir = entry.path if name == "llm" else entry.path / name
            try:
                for file in weights["files"]:
                    os.link(src_dir / file, out_dir / file)
            except OSError:
                for file in weights["files"]:
                    (out_dir / file).unlink(missing_ok=True)
                continue
            log.info("weights shared with bundle %s (hard links)", entry.key)
            return list(weights["files"])
    return None


def _write_shards(
    checkpoint,
    out_dir: Path,
    dtype: str | None,
    mode: str,
    progress: Progress | None,
    part: str | None = None,
):
    """Write the weights in shards, quantizing those ``mode`` asks for; returns (files, counts by format).
    Only the tensors of ``part`` ("vision", a speech component; None: the LLM's)."""
    from safetensors.torch import save_file

    from trtedge.runtime.multimodal import is_encoder_tensor, is_unserved_tensor
    from trtedge.runtime.speech import speech_tensor_names

    total = len([k for k in checkpoint.quantization if k != "dominant"]) or None
    torch_dtype = _TORCH_DTYPES[dtype] if dtype else None
    names: list[str] = []
    counts: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"weights-{len(names) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        os.chmod(out_dir / name, 0o644)
        _fsync(out_dir / name)
        names.append(name)
        shard, size = {}, 0

    for i, (name, tensor) in enumerate(_source_tensors(checkpoint, mode)):
        if part in SPEECH_COMPONENTS:
            if speech_tensor_names(name) != part:
                continue
        elif is_encoder_tensor(name) != (part == "vision") or is_unserved_tensor(name):
            continue
        fmt = _stored_format(name, tensor.shape, mode, checkpoint.quantization)
        if fmt is None and mode == "auto" and isinstance(tensor, QuantizedTensor):
            fmt = tensor.format  # a pre-quantized checkpoint's layer keeps its format
        stored = _convert(name, tensor, fmt, torch_dtype)
        counts[fmt or "float"] = counts.get(fmt or "float", 0) + 1
        shard.update(stored)
        size += sum(t.nbytes for t in stored.values())
        if size >= _SHARD_BYTES:
            flush()
        if progress:
            progress("convert", i + 1, total)
    if shard or not names:
        flush()
    if len(names) == 1:
        os.rename(out_dir / names[0], out_dir / "weights.safetensors")
        names = ["weights.safetensors"]
    return names, counts


# Tensors the model concatenates into one layer at load (``layers.fused``): one format for the group.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _stored_format(name: str, shape, mode: str, sources: dict) -> str | None:
    """``target_format``, except that a tensor fused with its siblings at load (q/k/v, gate/up) takes
    int8 when their formats differ (a Q4_K_M file's Q6_K attn_v beside Q4_K attn_q and attn_k): the
    model would otherwise requantize the group on every launch."""
    fmt = target_format(name, shape, mode, sources.get(name))
    stem, dot, kind = name.rpartition(".")
    prefix, _, part = stem.rpartition(".")
    group = next((g for g in _FUSED_GROUPS if part in g), None)
    if group is None or not dot:
        return fmt
    siblings = [f"{prefix}.{p}.{kind}" for p in group]
    if not all(s in sources for s in siblings):
        return fmt  # not a full group in this checkpoint (a fused qkv_proj, or no recorded types)
    formats = {target_format(s, shape, mode, sources[s]) for s in siblings}  # siblings share the input size
    return fmt if len(formats) == 1 else "int8"


def _source_tensors(checkpoint, mode: str):
    if checkpoint.kind == "gguf" and mode in ("auto", "int4"):
        from trtedge.runtime.artifacts.gguf import iter_gguf_tensors

        # Q4_0/Q4_1 blocks kept as int4; with auto, Q8_0/Q4_K/Q5_K/Q6_K blocks kept as the file holds them
        return iter_gguf_tensors(checkpoint.path, keep_int4=True, keep_blocks=mode == "auto")
    return checkpoint.iter_tensors()


def _convert(name: str, tensor, fmt: str | None, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if isinstance(tensor, QuantizedTensor):
        if fmt == tensor.format:
            return tensor.stored(name)
        tensor = tensor.dequantize(dtype or torch.float32)
    if fmt is not None:
        return quantize(tensor, fmt).stored(name)
    return {name: (tensor if dtype is None else tensor.to(dtype)).contiguous()}


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _test_delay() -> None:
    # Tests kill a build mid-way (kill -9); this widens the window between the first file and the manifest.
    delay = float(os.environ.get("TRTEDGE_TEST_BUILD_DELAY", "0") or 0)
    if delay > 0:
        time.sleep(delay)
