"""The interactive terminal of `trtedge chat`: prompt-toolkit for input, rich for output."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory
from prompt_toolkit.key_binding import KeyBindings
from rich.cells import cell_len
from rich.console import Console
from rich.markdown import Markdown
from rich.text import Text

from trtedge.chat.backends import BackendError, ChatStream, TurnMetrics
from trtedge.chat.session import (
    COMMANDS,
    PARAM_KEYS,
    ChatSession,
    ThinkSplitter,
    context_warning,
    format_metrics,
)
from trtedge.chat.speech import SAMPLE_RATE, play, save_wav

# Text that rich renders differently from how it streamed: fences, headings, lists, emphasis, tables.
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")  # rich opens a list with a blank line
_MARKDOWN = re.compile(r"```|^\s{0,3}(#{1,6} |[-*+] |\d+[.)] |>|\|)|\*\*|__|`[^`\n]+`", re.MULTILINE)


def history_path() -> Path:
    """$TRTEDGE_CHAT_HISTORY, else $XDG_DATA_HOME/trtedge/chat_history (~/.local/share by default)."""
    override = os.environ.get("TRTEDGE_CHAT_HISTORY")
    if override:
        return Path(override).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "trtedge" / "chat_history"


class SlashCompleter(Completer):
    """Completes /commands, /think on|off, /params keys and /save, /load or /audio paths."""

    def __init__(self) -> None:
        self._paths = PathCompleter(expanduser=True)

    def get_completions(self, document, complete_event):
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        command, space, arg = text.partition(" ")
        if not space:
            for name, (_args, help_text) in COMMANDS.items():
                if name.startswith(command[1:]):
                    yield Completion(f"/{name}", -len(command), display_meta=help_text)
            return
        word = arg.rsplit(" ", 1)[-1]
        if command == "/think":
            options = ("on", "off")
        elif command == "/params" and "=" not in word:
            options = tuple(f"{k}=" for k in PARAM_KEYS)
        elif command == "/speak":
            options = ("on", "off")
        elif command in ("/save", "/load", "/audio", "/save-audio"):
            yield from self._paths.get_completions(Document(arg, len(arg)), complete_event)
            return
        else:
            return
        for option in options:
            if option.startswith(word):
                yield Completion(option, -len(word))


def _key_bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("enter")
    def _send(event) -> None:
        event.current_buffer.validate_and_handle()

    @kb.add("escape", "enter")
    @kb.add("c-j")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    return kb


class ChatApp:
    """The read-answer loop over a backend and a session."""

    def __init__(
        self,
        backend,
        session: ChatSession,
        *,
        console: Console | None = None,
        markdown: bool = True,
        terminal_input=None,
        terminal_output=None,
    ):
        """``terminal_input``/``terminal_output`` are prompt-toolkit's (tests pass a pipe and a dummy)."""
        self.backend = backend
        self.session = session
        self.console = console or Console(highlight=False)
        self.markdown = markdown
        path = history_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prompt = PromptSession(
            history=FileHistory(str(path)),
            multiline=True,
            key_bindings=_key_bindings(),
            completer=SlashCompleter(),
            complete_while_typing=True,
            prompt_continuation=lambda width, line, soft: "." * (width - 1) + " ",
            enable_history_search=False,
            reserve_space_for_menu=0,
            input=terminal_input,
            output=terminal_output,
        )

    def run(self) -> int:
        self._banner()
        interrupted = False
        while True:
            try:
                line = self.prompt.prompt([("bold", "> ")])
            except KeyboardInterrupt:
                if interrupted:
                    break
                interrupted = True
                self.console.print("(Ctrl-C again or Ctrl-D to leave)", style="dim")
                continue
            except EOFError:
                break
            interrupted = False
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and "\n" not in text:
                if self._command(text) == "exit":
                    break
                continue
            self.session.add_user(line.strip("\n"))
            self._answer()
        self.console.print("bye", style="dim")
        return 0

    # ---- commands -------------------------------------------------------------------------------
    def _banner(self) -> None:
        b, s = self.backend, self.session
        context = f"context {s.max_context} tokens" if s.max_context else "context size unknown"
        where = getattr(b, "url", None) or dict(b.describe()).get("device", "")
        self.console.print(
            Text.assemble(("trtedge chat", "bold"), f" · {b.model_name} · {where} · {context}")
        )
        self.console.print(
            "/help lists commands · Alt-Enter new line · Ctrl-C stops an answer · Ctrl-D leaves", style="dim"
        )

    def _command(self, text: str) -> str | None:
        result = self.session.execute(text)
        if result.message:
            if result.error:
                self.console.print(Text(f"error: {result.message}", style="bold red"))
            else:
                self.console.print(Text(result.message))
        if result.action == "retry":
            self._answer()
        elif result.action == "save-audio":
            self._save_audio(Path(result.argument).expanduser())
        elif result.action == "model":
            rows = self.backend.describe()
            width = max(len(k) for k, _ in rows)
            for key, value in rows:
                self.console.print(Text.assemble((f"  {key:<{width}}  ", "dim"), value))
        return result.action

    # ---- answers --------------------------------------------------------------------------------
    def _answer(self) -> None:
        session = self.session
        try:
            stream = self.backend.stream(session.conversation(), session.params)
        except KeyboardInterrupt:
            session.drop_unanswered()
            self.console.print(Text("[cancelled]", style="dim"))
            return
        except (BackendError, ValueError) as e:
            session.drop_unanswered()
            hint = " (/clear starts over)" if session.messages else ""
            self.console.print(Text(f"error: {e}{hint}", style="bold red"))
            return
        try:
            answer = self._render(stream)
        except BackendError as e:
            session.drop_unanswered()
            self.console.print(Text(f"\nerror: {e}", style="bold red"))
            return
        metrics = stream.metrics or stream.wait_metrics(2.0)
        if answer.strip():
            session.add_answer(answer)
        else:
            session.drop_unanswered()
        if stream.cancelled:
            self.console.print(Text("[cancelled]", style="dim"))
        if metrics is not None:
            self._status(metrics)
        if session.speak and answer.strip() and not stream.cancelled:
            audio = self._speech()
            if audio is not None:
                problem = play(audio)
                if problem:
                    self.console.print(Text(f"error: {problem}", style="bold red"))

    def _speech(self):
        """The last answer's speech, made once (None after an error, which is shown)."""
        session = self.session
        if session.last_audio is None:
            try:
                session.last_audio = self.backend.speak(session.last_answer(), None)
            except (BackendError, ValueError) as e:
                self.console.print(Text(f"error: {e}", style="bold red"))
                return None
            except KeyboardInterrupt:
                self.console.print(Text("[cancelled]", style="dim"))
                return None
        return session.last_audio

    def _save_audio(self, path: Path) -> None:
        audio = self._speech()
        if audio is None:
            return
        try:
            save_wav(path, audio)
        except OSError as e:
            self.console.print(Text(f"error: /save-audio: {e}", style="bold red"))
            return
        self.console.print(Text(f"wrote {path} ({audio.shape[0] / SAMPLE_RATE:.1f} s of speech)"))

    def _render(self, stream: ChatStream) -> str:
        """Show the stream as it comes; return the answer without its reasoning."""
        view = _StreamView(self.console, self.session.show_thinking)
        splitter = ThinkSplitter()
        with _sigint_cancels(stream):
            for chunk in stream:
                pieces = [(True, chunk.text)] if chunk.reasoning else splitter.feed(chunk.text)
                for reasoning, text in pieces:
                    view.show(reasoning, text)
            for reasoning, text in splitter.flush():
                view.show(reasoning, text)
        view.finish(self.markdown and not stream.cancelled)
        return view.answer

    def _status(self, m: TurnMetrics) -> None:
        self.session.record(m)
        self.console.print(Text(format_metrics(m, self.session.max_context), style="dim cyan"))
        warning = context_warning(self.session.context_tokens, self.session.max_context)
        if warning:
            self.console.print(Text(f"warning: {warning}", style="yellow"))


class _StreamView:
    """Writes reasoning (dimmed, or collapsed to one line) and the answer as they stream; at the end
    re-renders the answer as Markdown when it has Markdown in it and still fits on the screen."""

    def __init__(self, console: Console, show_thinking: bool):
        self.console = console
        self.show_thinking = show_thinking
        self.answer = ""
        self.reasoning = ""
        self._in_reasoning = False
        self._answer_started = False
        self._wrap = _WordWrap(console.width) if console.is_terminal else None
        self._style: str | None = None
        self._shown = ""  # the answer as written, with the line breaks the wrap put in

    def show(self, reasoning: bool, text: str) -> None:
        if reasoning:
            if not self._in_reasoning:
                self._in_reasoning = True
                if not self.show_thinking:
                    self._write("thinking…", "dim italic")
            self.reasoning += text
            if self.show_thinking:
                self._write(text, "dim italic")
            return
        if self._in_reasoning:
            self._close_reasoning()
        if not self._answer_started:
            text = text.lstrip("\n")
            if not text:
                return
            self._answer_started = True
        self.answer += text
        self._shown += self._write(text)

    def _close_reasoning(self) -> None:
        self._in_reasoning = False
        if self.show_thinking:
            self._write("\n\n")
        else:
            words = len(self.reasoning.split())
            if self.console.is_terminal:
                self._flush()
                self.console.file.write("\r\x1b[K")  # over "thinking…"
                self._wrap.column = 0
            else:
                self._write("\n")
            self._write(f"[reasoning: {words} words hidden; /think on shows it]\n", "dim")

    def finish(self, markdown: bool) -> None:
        if self._in_reasoning:
            self._close_reasoning()
        self._shown += self._flush()
        if markdown and self._fits() and _MARKDOWN.search(self.answer):
            rows = _rows(self._shown, self.console.width)
            self.console.file.write("\r" + (f"\x1b[{rows - 1}A" if rows > 1 else "") + "\x1b[J")
            with self.console.capture() as rendered:
                self.console.print(Markdown(self.answer))
            self.console.file.write(_LEADING_BLANK_LINES.sub("", rendered.get()))
            self.console.file.flush()
        elif self.answer and not self.answer.endswith("\n"):
            self._write("\n")

    def _fits(self) -> bool:
        c = self.console
        return (
            c.is_terminal
            and not c.is_dumb_terminal
            and "\t" not in self.answer
            and "\r" not in self.answer
            and _rows(self._shown, c.width) < c.height - 1
        )

    def _write(self, text: str, style: str | None = None) -> str:
        """Write ``text`` (on a terminal, broken at spaces to the width); returns what was written."""
        if self._wrap is None:
            self._print(text, style)
            return text
        if style != self._style:
            self._flush()
            self._style = style
        now = self._wrap.feed(text)
        self._print(now, style)
        return now

    def _flush(self) -> str:
        """Write the word the wrap holds back; returns it."""
        if self._wrap is None:
            return ""
        rest = self._wrap.flush()
        self._print(rest, self._style)
        return rest

    def _print(self, text: str, style: str | None) -> None:
        if text:
            self.console.print(Text(text, style=style or ""), end="", soft_wrap=True)


class _WordWrap:
    """Breaks streamed text at spaces before a word would cross the terminal's last column (the terminal
    itself breaks mid-word). A word is held back until it ends, since only then is its width known; a
    word wider than the screen is broken at the column."""

    def __init__(self, width: int):
        self.width = max(1, width)
        self.column = 0
        self._word = ""

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if ch in "\n\r":
                out += [self._place(), ch]
                self.column = 0
            elif ch in " \t":
                out.append(self._place())
                step = 1 if ch == " " else 8 - self.column % 8
                if self.column + step > self.width:
                    out.append("\n")  # the space becomes the line break
                    self.column = 0
                else:
                    out.append(ch)
                    self.column += step
            else:
                self._word += ch
                if cell_len(self._word) >= self.width:
                    out.append(self._place())
        return "".join(out)

    def flush(self) -> str:
        return self._place()

    def _place(self) -> str:
        word, self._word = self._word, ""
        width = cell_len(word)
        if self.column and self.column + width > self.width:
            self.column = width
            return "\n" + word
        self.column += width
        return word


def _rows(text: str, width: int) -> int:
    """Terminal rows ``text`` took when written from column 0 of a line (the cursor is on the last one)."""
    return sum(max(1, -(-cell_len(line) // width)) for line in text.split("\n"))


@contextmanager
def _sigint_cancels(stream: ChatStream):
    """While an answer streams, Ctrl-C cancels it instead of raising KeyboardInterrupt. The cancel
    runs on its own thread: a signal handler must not take locks the interrupted code may hold."""

    def handler(signum, frame) -> None:
        threading.Thread(target=stream.cancel, daemon=True).start()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with _no_echo():
            yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _no_echo():
    """Keys typed while an answer streams (and the "^C" of a cancel) would land inside the answer: turn
    the terminal's echo off meanwhile. Typed-ahead input stays queued for the next prompt."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, io.UnsupportedOperation):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
