#!/usr/bin/env python3
"""Write docs/cli-reference.md from the Typer app: every command, argument and flag with its type,
default and help, so the reference cannot drift from the code. With --check, only say whether the
page is current (exit 1 when stale); the tests run it."""

from __future__ import annotations

import sys
from pathlib import Path

import typer.main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli-reference.md"
HEADER = """# CLI reference

Generated from the Typer app by `scripts/generate_cli_reference.py`; do not edit by hand. The
guides explain the commands: [Command line](cli.md), [Terminal chat](chat.md),
[HTTP server](server.md), [The bundle cache](cache.md).
"""


def render() -> str:
    from trtedge.cli import app

    root = typer.main.get_command(app)
    parts = [HEADER]
    _command(root, ["trtedge"], parts)
    return "\n".join(parts).rstrip() + "\n"


def _command(command, path: list[str], parts: list[str]) -> None:
    ctx = command.make_context(path[-1], [], resilient_parsing=True)
    name = " ".join(path)
    parts.append(f"{'#' * min(len(path) + 1, 4)} `{name}`\n")
    if command.help:
        parts.append(_text(command.help) + "\n")
    pieces = " ".join(command.collect_usage_pieces(ctx))
    parts.append(f"```text\n{name} {pieces}\n```\n")
    rows = [_row(p, ctx) for p in command.params if not getattr(p, "hidden", False)]
    if rows:
        parts.append("| argument / flag | type | default | meaning |\n| --- | --- | --- | --- |")
        parts.extend(rows)
        parts.append("")
    for sub in getattr(command, "commands", {}).values():
        if not sub.hidden:
            _command(sub, [*path, sub.name], parts)


def _row(param, ctx) -> str:
    if param.param_type_name == "argument":
        names = f"`{param.name.upper()}`"
    else:
        names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    flag = getattr(param, "is_flag", False)
    kind = "flag" if flag else param.display_type(ctx).strip("<>")
    if flag:
        default = "on" if param.default else "off"
    elif param.default in (None, ""):
        default = "none"
    else:
        default = f"`{param.default}`"
    help_text = _text(getattr(param, "help", None) or "")
    if param.envvar:
        help_text += f" (env: `${param.envvar}`)" if f"${param.envvar}" not in help_text else ""
    return f"| {names} | {kind} | {default} | {help_text} |"


def _text(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str]) -> int:
    from _pages import write_or_check

    return write_or_check(PAGE, render(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
