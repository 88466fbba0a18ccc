#!/usr/bin/env python3
"""Write docs/cli-reference.md from the Typer app: every command, argument and flag with its type,
default and help, so the reference cannot drift from the code. The guides' flag tables are generated
too: a block `<!-- flags: trtedge serve -->` ... `<!-- /flags -->` in a docs page is rewritten with that
command's flags. With --check, only say whether the pages are current (exit 1 when stale); the tests
run it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer.main

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "cli-reference.md"
GUIDES = ("cli.md", "server.md", "bench.md")
BLOCK = re.compile(r"(<!-- flags: (trtedge[\w -]*?) -->\n).*?(<!-- /flags -->)", re.S)
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


def commands() -> dict[str, object]:
    """Every command by its full name ("trtedge bench run"), with the click command."""
    from trtedge.cli import app

    found: dict[str, object] = {}

    def walk(command, name: str) -> None:
        found[name] = command
        for sub in getattr(command, "commands", {}).values():
            if not sub.hidden:
                walk(sub, f"{name} {sub.name}")

    walk(typer.main.get_command(app), "trtedge")
    return found


def flags(command) -> list:
    """The options a guide documents: all but --help."""
    return [
        p
        for p in command.params
        if p.param_type_name == "option" and not getattr(p, "hidden", False) and p.name != "help"
    ]


def flag_table(command) -> str:
    ctx = command.make_context(command.name, [], resilient_parsing=True)
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for param in flags(command):
        names, _kind, default, help_text = _cells(param, ctx)
        rows.append(f"| {names} | {default} | {help_text} |")
    return "\n".join(rows) + "\n"


EXIT_BLOCK = re.compile(r"(<!-- exit-status -->\n).*?(<!-- /exit-status -->)", re.S)


def exit_table() -> str:
    from trtedge.commands.exit_codes import MEANING

    rows = ["| status | meaning |", "| --- | --- |"]
    rows += [f"| {code} | {_text(meaning)} |" for code, meaning in MEANING.items()]
    return "\n".join(rows) + "\n"


def guide(text: str) -> str:
    """A docs page with every flags block (and the exit-status table) regenerated from the code."""
    found = commands()
    text = EXIT_BLOCK.sub(lambda m: m.group(1) + exit_table() + m.group(2), text)

    def fill(match: re.Match) -> str:
        name = match.group(2).strip()
        if name not in found:
            raise SystemExit(f"a flags block names {name!r}, which is not a command")
        return match.group(1) + flag_table(found[name]) + match.group(3)

    return BLOCK.sub(fill, text)


def _row(param, ctx) -> str:
    return "| {} | {} | {} | {} |".format(*_cells(param, ctx))


def _cells(param, ctx) -> tuple[str, str, str, str]:
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
    return names, kind, default, help_text


def _text(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str]) -> int:
    from _pages import write_or_check

    stale = write_or_check(PAGE, render(), argv)
    for name in GUIDES:
        page = DOCS / name
        stale |= write_or_check(page, guide(page.read_text()), argv)
    return stale


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
