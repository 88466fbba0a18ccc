"""How `--help` looks: Typer's rich panels, with two habits of its own mended in one place.

- On/off flags show no value placeholder (Typer prints `<bool>` as if they took a value).
- A word wider than its column (a long flag name, `auto|none|qwen3|...`) folds onto the next line
  instead of ending in `…`, so an 80-column terminal still shows every flag and every choice.
Both are guarded: a Typer without these internals keeps its own rendering.
"""

from __future__ import annotations

import typer.core

try:
    import typer.rich_utils as rich_utils
except ImportError:  # Typer without rich
    rich_utils = None


def install() -> None:
    option = typer.core.TyperOption
    display = getattr(option, "display_type_rich", None)
    if display is not None and not getattr(display, "_trtedge", False):

        def display_type_rich(self, ctx):
            return None if self.is_flag else display(self, ctx)

        display_type_rich._trtedge = True
        option.display_type_rich = display_type_rich
    for name in ("highlighter", "negative_highlighter"):
        current = getattr(rich_utils, name, None)
        if current is not None and not isinstance(current, _Folding):
            setattr(rich_utils, name, _folding(type(current))())


class _Folding:
    pass


def _folding(base: type) -> type:
    class Folding(_Folding, base):
        def highlight(self, text) -> None:
            super().highlight(text)
            text.overflow = "fold"

    return Folding
