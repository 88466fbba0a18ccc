"""Resolve what the user names as a model into a readable checkpoint.

A model is a local Hugging Face directory, a Hugging Face id (downloaded into
``<cache_dir>/checkpoints``), a GGUF file, or nothing (the embedded default model).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trtedge.runtime.artifacts.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from trtedge.runtime.artifacts.prequantized import QuantizationFormatError, Scheme, convert, detect
from trtedge.runtime.models.config import ModelConfig, UnsupportedModelError

log = logging.getLogger("trtedge")

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ENGINE_FILES = ("*.engine", "*.plan", "*.trt", "*.onnx")


class CheckpointError(ValueError):
    """The model could not be resolved or read; the message is one line naming the file or id."""


def default_cache_dir() -> Path:
    env = os.environ.get("TRTEDGE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trtedge"


@dataclass
class Checkpoint:
    source: str  # what the user passed (or the embedded model's name)
    path: Path  # the directory or the GGUF file
    kind: str  # "hf" | "gguf"
    config: dict
    tokenizer_files: dict = field(default_factory=dict)  # for GGUF: tokenizer_json/config/generation
    quantization: dict = field(default_factory=dict)  # GGUF: tensor name -> its block type
    scheme: Scheme | None = None  # a checkpoint published pre-quantized (FP8, AWQ, GPTQ, NVFP4)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.config, source=str(self.path))

    @property
    def name(self) -> str:
        return self.source

    def weight_files(self) -> list[Path]:
        """The safetensors files holding the weights (none for a GGUF file)."""
        return [] if self.kind == "gguf" else safetensors_files(self.path)

    def iter_tensors(self, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF tensor name, tensor) in the checkpoint's own dtype (GGUF: dequantized float32); a
        pre-quantized checkpoint's layers come as QuantizedTensors (``prequantized.convert``) under
        their ``.weight`` name. Tensors named in ``skip`` are not read (safetensors files)."""
        if self.kind == "gguf":
            from trtedge.runtime.artifacts.gguf import iter_gguf_tensors

            yield from iter_gguf_tensors(self.path)
            return
        if self.scheme is not None:
            try:
                yield from convert(self._read_safetensors(skip), self.scheme)
            except QuantizationFormatError as e:
                raise CheckpointError(f"{self.path}: {e}") from None
            return
        yield from self._read_safetensors(skip)

    def _read_safetensors(self, skip: Container[str]) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in safetensors_files(self.path):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        if name not in skip:
                            yield name, f.get_tensor(name)
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from None

    def load_tokenizer(self):
        from trtedge.runtime.text.tokenizer import Tokenizer

        if self.kind == "gguf":
            t = self.tokenizer_files
            cfg = t["tokenizer_config"]
            return Tokenizer(t["tokenizer_json"], cfg, cfg.get("chat_template"), t["generation_config"])
        if not (self.path / "tokenizer.json").is_file():
            raise CheckpointError(f"{self.path}: no tokenizer.json (trtedge needs a fast tokenizer file)")
        return Tokenizer.from_dir(self.path)


def resolve_checkpoint(
    model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None
) -> Checkpoint:
    """The one entry point every command and ``LLM`` use to turn a model argument into a checkpoint."""
    if model is None or str(model) == "":
        path = embedded_model_path()
        log.info("no model given: using the embedded default model %s (%s)", EMBEDDED_MODEL_NAME, path)
        return _gguf_checkpoint(path, EMBEDDED_MODEL_NAME)
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        return _local_checkpoint(path, text)
    if _HF_ID.match(text) and not text.startswith((".", "/", "~")):
        return _hub_checkpoint(text, Path(cache_dir) if cache_dir else default_cache_dir())
    raise CheckpointError(
        f"{text}: no such file or directory (and not a Hugging Face model id like org/name)"
    )


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    return sorted(directory.glob("*.safetensors"))


def _local_checkpoint(path: Path, source: str) -> Checkpoint:
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_checkpoint(path, source)
        if path.suffix.lower() in (".onnx", ".engine", ".plan", ".trt"):
            raise _engine_error(path)
        raise CheckpointError(
            f"{path}: not a model; pass a Hugging Face directory, a Hugging Face id or a .gguf file"
        )
    gguf = local_gguf(path)
    if gguf is not None:
        return _gguf_checkpoint(gguf, source)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; a Hugging Face checkpoint directory needs one")
    return _hf_checkpoint(path, source)


def local_gguf(path: Path) -> Path | None:
    """The GGUF file a local model path stands for, found without reading it: the path itself, or the
    only ``.gguf`` of a directory that has no config.json (and is not an exported engine)."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    if any(any(path.glob(p)) for p in _ENGINE_FILES):
        raise _engine_error(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1 and not (path / "config.json").is_file():
        return ggufs[0]
    return None


def _engine_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: looks like an exported ONNX model or a prebuilt engine; "
        "pass the original checkpoint (Hugging Face directory or id, or a .gguf file) and trtedge builds it"
    )


def _hf_checkpoint(path: Path, source: str) -> Checkpoint:
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_file}: cannot read config.json ({e})") from None
    _check_model_type(config, config_file)
    files = safetensors_files(path)
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights (other weight formats are not supported)")
    for file in files:
        _check_safetensors(file)
    try:
        scheme = detect(config, path)
    except QuantizationFormatError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return Checkpoint(source=source, path=path, kind="hf", config=config, scheme=scheme)


def config_only_checkpoint(model: str | os.PathLike) -> Checkpoint:
    """A directory with config.json and tokenizer.json but no weights (for ``load_format="dummy"``)."""
    path = Path(model).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{path}: load_format dummy needs a directory with config.json and tokenizer.json"
        )
    config = json.loads(config_file.read_text())
    _check_model_type(config, config_file)
    return Checkpoint(source=str(model), path=path, kind="dummy", config=config)


def _check_model_type(config: dict, source: Path) -> None:
    try:
        ModelConfig.from_hf(config, source=str(source))
    except UnsupportedModelError as e:
        raise CheckpointError(str(e)) from None


def _check_safetensors(file: Path) -> None:
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointError(f"{file}: listed in the index but missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except Exception as e:
        raise CheckpointError(f"{file}: corrupt safetensors file ({e})") from None


def _gguf_checkpoint(path: Path, source: str) -> Checkpoint:
    from trtedge.runtime.artifacts.gguf import GGUFError, read_gguf

    try:
        contents = read_gguf(path)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    _check_model_type(contents.config, path)
    files = {
        "tokenizer_json": contents.tokenizer_json,
        "tokenizer_config": contents.tokenizer_config,
        "generation_config": contents.generation_config,
    }
    return Checkpoint(
        source=source,
        path=path,
        kind="gguf",
        config=contents.config,
        tokenizer_files=files,
        quantization=contents.quantization,
    )


def _hub_checkpoint(model_id: str, cache_dir: Path) -> Checkpoint:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    target = cache_dir / "checkpoints"
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
    try:
        path = snapshot_download(
            model_id, cache_dir=str(target), allow_patterns=patterns, token=os.environ.get("HF_TOKEN")
        )
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{model_id}: not in the local cache ({target}) and cannot be downloaded "
            "(offline or no network); connect and retry, unset HF_HUB_OFFLINE, or pass a local directory"
        ) from None
    except GatedRepoError:
        raise CheckpointError(
            f"{model_id}: gated on Hugging Face; set HF_TOKEN to a token with access"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{model_id}: no such model on Hugging Face (or it is private: set HF_TOKEN)"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{model_id}: download failed ({type(e).__name__}: {e})") from None
    return _local_checkpoint(Path(path), model_id)
