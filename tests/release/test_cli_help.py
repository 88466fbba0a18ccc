"""`--help` of every command shows every word of every help text: nothing eaten as rich markup, nothing
cut at 80 columns, no value placeholder on an on/off flag; `trtedge bench --help` shows run's flags."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from trtedge.cli import app


def _commands(command, path: list[str]):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from _commands(sub, [*path, name])


COMMANDS = list(_commands(typer.main.get_command(app), []))
IDS = [" ".join(["trtedge", *p]) for p, _ in COMMANDS]


def _help(path: list[str], columns: int) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def _words(text: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_help_shows_every_help_text_whole(path, command):
    shown = _words(_help(path, 1000))
    for param in command.params:
        text = getattr(param, "help", None)
        if text:
            assert _words(text) in shown, f"{param.name}: help text altered in --help"


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_help_at_80_columns_cuts_nothing(path, command):
    out = _help(path, 80)
    assert "…" not in out, out


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_on_off_flags_show_no_value_placeholder(path, command):
    lines = _help(path, 1000).splitlines()
    for param in command.params:
        if getattr(param, "is_flag", False):
            line = next(x for x in lines if re.search(rf"{re.escape(param.opts[0])}\b", x))
            assert "<bool>" not in line, line


def test_bench_help_shows_the_flags_of_its_default_run():
    out = _help(["bench"], 1000)
    assert "compare" in out
    for flag in ("--url", "--num-prompts", "--concurrency", "--plot", "--json"):
        assert flag in out
