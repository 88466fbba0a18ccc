"""Pieces of the terminal UI that need no terminal: completion, history location, the stream view."""

from __future__ import annotations

import io

from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from rich.console import Console

from trtedge.chat.tui import SlashCompleter, _rows, _StreamView, history_path


def _complete(text: str) -> list[str]:
    return [c.text for c in SlashCompleter().get_completions(Document(text), CompleteEvent())]


def test_slash_commands_complete():
    assert _complete("/")[:3] == ["/help", "/system", "/clear"]
    assert _complete("/pa") == ["/params"]
    assert _complete("/think o") == ["on", "off"]
    assert _complete("/params temperature=0.1 se") == ["seed="]
    assert _complete("hello /") == []


def test_save_and_load_complete_paths(tmp_path, monkeypatch):
    (tmp_path / "chat.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    assert _complete("/load ch") == ["at.json"]  # the rest of chat.json


def test_history_file_location(monkeypatch, tmp_path):
    monkeypatch.delenv("TRTEDGE_CHAT_HISTORY", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert history_path() == tmp_path / "trtedge" / "chat_history"
    monkeypatch.setenv("TRTEDGE_CHAT_HISTORY", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h"


def test_rows_count_wrapped_lines():
    assert _rows("abc", 10) == 1
    assert _rows("a" * 10, 10) == 1
    assert _rows("a" * 11, 10) == 2
    assert _rows("a\n\nb\n", 10) == 4


def _view(show_thinking: bool, terminal: bool = False):
    out = io.StringIO()
    console = Console(file=out, width=60, height=20, force_terminal=terminal, color_system=None)
    return _StreamView(console, show_thinking), out


def test_reasoning_is_collapsed_to_one_line_by_default():
    view, out = _view(False)
    for reasoning, text in [(True, "let me think about it"), (False, "\nThe answer."), (False, " Yes.")]:
        view.show(reasoning, text)
    view.finish(markdown=True)
    assert view.answer == "The answer. Yes."
    assert view.reasoning == "let me think about it"
    text = out.getvalue()
    assert "let me think" not in text and "[reasoning: 5 words hidden; /think on shows it]" in text
    assert text.endswith("The answer. Yes.\n")


def test_reasoning_is_shown_with_think_on():
    view, out = _view(True)
    view.show(True, "pondering")
    view.show(False, "Done.")
    view.finish(markdown=False)
    assert "pondering\n\nDone.\n" in out.getvalue()


def test_markdown_answer_is_redrawn_in_place_on_a_terminal():
    view, out = _view(False, terminal=True)
    view.show(False, "Fruits:\n\n- **apple**\n- pear")
    view.finish(markdown=True)
    text = out.getvalue()
    assert "\x1b[3A\x1b[J" in text  # back to the answer's first row, then clear
    rendered = text.split("\x1b[J", 1)[1]
    assert "**" not in rendered and "apple" in rendered and "•" in rendered


def _terminal_view(width: int):
    out = io.StringIO()
    console = Console(file=out, width=width, height=40, force_terminal=True, color_system=None)
    return _StreamView(console, show_thinking=False), out


def test_a_streamed_answer_wraps_at_word_boundaries_on_a_terminal():
    view, out = _terminal_view(20)
    answer = "Sure, I can help you create a small program that counts words in a file."
    for i in range(0, len(answer), 3):  # chunks that end mid-word, as tokens do
        view.show(False, answer[i : i + 3])
    view.finish(markdown=False)
    lines = out.getvalue().split("\n")
    assert all(len(line) <= 20 for line in lines)
    assert [w for line in lines for w in line.split()] == answer.split()  # no word cut in two
    assert lines[0] == "Sure, I can help you" and lines[1].startswith("create")
    assert view.answer == answer


def test_a_word_wider_than_the_terminal_is_broken_at_the_column():
    view, out = _terminal_view(10)
    view.show(False, "see " + "x" * 25 + " ok")
    view.finish(markdown=False)
    assert out.getvalue() == "see \n" + "x" * 10 + "\n" + "x" * 10 + "\n" + "x" * 5 + " ok\n"


def test_markdown_redraw_counts_the_rows_the_wrapped_answer_took():
    view, out = _terminal_view(20)
    view.show(False, "- **a** " + "b" * 14 + " " + "c" * 14 + " d")  # 39 cells: 3 rows once wrapped at spaces
    view.finish(markdown=True)
    assert "\x1b[2A\x1b[J" in out.getvalue()
