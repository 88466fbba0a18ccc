"""`build --components ...`: turn a checkpoint into a bundle directory (weights, tokenizer, template).

GGUF weights are dequantized once into ``weights.safetensors`` (float32 or the profile dtype); HF
safetensors that need no dtype cast are not copied: the manifest lists them with their digests and
loading verifies them. Fused projection layouts are still made by the model at load time.
A converted weight set is hard-linked from another bundle of the same checkpoint and dtype when one
exists, so profiles that differ only in lengths or batch size share one copy on disk.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trtedge._version import __version__
from trtedge.runtime.bundle import TEXT_FILES, BuildProfile, Cache, digest_json, now_iso
from trtedge.runtime.bundle import fingerprint as checkpoint_fingerprint

log = logging.getLogger("trtedge")

Progress = Callable[[str, int, "int | None"], None]

_SHARD_BYTES = 2 * 2**30
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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


def _build_component(checkpoint, profile, out_dir: Path, fp, cache, progress) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    fp = fp or checkpoint_fingerprint(checkpoint.path)
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
    dtype = _stored_dtype(checkpoint, profile.dtype)
    if dtype is None:
        weights = {name: digest for name, digest in fp[1].items() if name.endswith(".safetensors")}
        section["weights"] = {"externalized": True, "files": weights, "dtype": "checkpoint"}
        return section
    weights_key = digest_json({"checkpoint": fp[0], "dtype": dtype, "layout": profile.layout_version})[:24]
    files = _link_weights(cache, weights_key, out_dir) if cache else None
    if files is None:
        files = _write_shards(checkpoint, out_dir, _TORCH_DTYPES[dtype], progress)
    section["weights"] = {"externalized": False, "files": files, "dtype": dtype, "key": weights_key}
    return section


def _stored_dtype(checkpoint, dtype: str) -> str | None:
    """The dtype to write weights in, or None when the checkpoint's own files serve as they are."""
    if checkpoint.kind == "gguf":
        return dtype if dtype in _TORCH_DTYPES else "float32"
    if dtype == "auto" or _safetensors_dtypes(checkpoint.path) <= {dtype}:
        return None
    return dtype


def _safetensors_dtypes(path: Path) -> set[str]:
    from trtedge.runtime.checkpoint import safetensors_files

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
            src_dir = entry.path / "draft" if name == "draft" else entry.path
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


def _write_shards(checkpoint, out_dir: Path, dtype: torch.dtype, progress: Progress | None) -> list[str]:
    from safetensors.torch import save_file

    total = len([k for k in checkpoint.quantization if k != "dominant"]) or None
    names: list[str] = []
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

    for i, (name, tensor) in enumerate(checkpoint.iter_tensors()):
        tensor = tensor.to(dtype).contiguous()
        shard[name] = tensor
        size += tensor.nbytes
        if size >= _SHARD_BYTES:
            flush()
        if progress:
            progress("convert", i + 1, total)
    if shard or not names:
        flush()
    if len(names) == 1:
        os.rename(out_dir / names[0], out_dir / "weights.safetensors")
        names = ["weights.safetensors"]
    return names


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
