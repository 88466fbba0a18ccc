"""Shared by the page generators: write a generated page, or with --check say whether it is current."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(page: Path, text: str, argv: list[str]) -> int:
    """Write ``text`` to ``page`` (exit status 0); with ``--check`` in argv, only compare: 1 when stale."""
    script = Path(sys.argv[0]).name
    if "--check" in argv:
        if not page.exists() or page.read_text() != text:
            print(f"{page} is stale: run scripts/{script}", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    print(f"wrote {page}")
    return 0
