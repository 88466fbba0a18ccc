"""A draft head's directory as published (EAGLE-3 heads, DFlash drafts): ``config.json`` and the
``*.safetensors`` files beside it."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_head(
    path: str | Path, what: str, architectures: tuple[str, ...]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the head in ``path``; ``what`` names it in errors (``"EAGLE-3 head"``). A
    config whose ``architectures`` name none of ``architectures`` is refused."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{what} {path}: no config.json")
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if archs and not any(a in architectures for a in archs):
        raise ValueError(f"{what} {path}: architectures {archs} is not one of {', '.join(architectures)}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{what} {path}: no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return config, tensors
