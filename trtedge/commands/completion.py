"""Shell-completion candidates that come from the cache (the scripts in completions/ call back into
`trtedge`, so these stay current)."""

from __future__ import annotations

import os


def cached_models(incomplete: str) -> list[str]:
    """Model arguments the cache knows: those of built bundles and the downloaded Hugging Face ids."""
    try:
        from trtedge.runtime.artifacts.cache import Cache
        from trtedge.runtime.artifacts.embedded import EMBEDDED_MODEL_NAME

        cache = Cache(os.environ.get("TRTEDGE_CACHE_DIR") or None)
        names = {e.model for e in cache.entries()} - {EMBEDDED_MODEL_NAME, "?"}
        checkpoints = cache.root / "checkpoints"
        if checkpoints.is_dir():
            for path in checkpoints.glob("models--*--*"):
                names.add(path.name.removeprefix("models--").replace("--", "/", 1))
    except Exception:  # completion must never print a traceback into the user's shell
        return []
    return sorted(n for n in names if n.startswith(incomplete))
