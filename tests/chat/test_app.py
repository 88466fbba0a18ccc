"""The read-answer loop in-process: prompt-toolkit reads from a pipe, rich writes to a string, and a
scripted backend answers (reasoning included), so the loop's handling of commands, answers, errors
and cancels is checked without a model or a pseudo-terminal."""

from __future__ import annotations

import io
import threading

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from trtedge.chat.backends import BackendError, ChatStream, Chunk, TurnMetrics
from trtedge.chat.session import ChatSession
from trtedge.chat.tui import ChatApp
from trtedge.runtime.sampling_params import SamplingParams


class _Stream(ChatStream):
    def __init__(self, pieces, cancel_after=None):
        super().__init__()
        self._go = threading.Event()
        n = 0
        for text, reasoning in pieces:
            if cancel_after is not None and n == cancel_after:
                break
            self._queue.put(Chunk(text, reasoning))
            n += 1
        if cancel_after is None:
            self._end(TurnMetrics(30, n, 0.1, 20.0, 0.5, "stop"))

    def _stop_producer(self):
        self._end(TurnMetrics(30, 1, 0.1, 20.0, 0.2, "cancelled"))


class ScriptedBackend:
    model_name = "scripted"
    max_context = 100
    url = None

    def __init__(self):
        self.sent = []
        self.answers = []

    def stream(self, messages, params):
        self.sent.append([dict(m) for m in messages])
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def describe(self):
        return [("model", self.model_name), ("device", "nowhere")]

    def close(self):
        pass


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTEDGE_CHAT_HISTORY", str(tmp_path / "history"))

    def run(backend, keys: str, session=None) -> str:
        out = io.StringIO()
        session = session or ChatSession(SamplingParams(max_tokens=16), max_context=backend.max_context)
        with create_pipe_input() as pipe:
            pipe.send_text(keys)
            app = ChatApp(
                backend,
                session,
                console=Console(file=out, width=200, color_system=None),
                terminal_input=pipe,
                terminal_output=DummyOutput(),
            )
            assert app.run() == 0
        return out.getvalue()

    return run


def test_answers_commands_and_reasoning(run):
    backend = ScriptedBackend()
    backend.answers = [
        _Stream([("<think>Paris is", False), (" the capital.</think>", False), ("Paris.", False)]),
        _Stream([("Still Paris.", False)]),
    ]
    text = run(backend, "capital of France?\r/params temperature=-1\r/retry\r/model\r/exit\r")
    assert "[reasoning: 4 words hidden; /think on shows it]" in text
    assert "Paris." in text and "Still Paris." in text
    assert "TTFT 100 ms · 20.0 tok/s · 3 tokens · latency 500 ms · context 33/100 (33%)" in text
    assert "error: /params: temperature must be >= 0.0" in text
    assert "device  nowhere" in text and text.rstrip().endswith("bye")
    # the retry sent the same question again, and the reasoning never went back to the model
    assert backend.sent[0] == backend.sent[1] == [{"role": "user", "content": "capital of France?"}]


def test_context_warning_and_errors_keep_the_session_going(run):
    backend = ScriptedBackend()
    big = _Stream([("x", False)])
    big.metrics.prompt_tokens = 90
    backend.answers = [big, BackendError("HTTP 400: prompt is too long")]
    session = ChatSession(SamplingParams(), max_context=100)
    text = run(backend, "one\rtwo\r/stats\r\x04", session)
    assert "warning: context nearly full: 9 tokens left" in text
    assert "error: HTTP 400: prompt is too long (/clear starts over)" in text
    assert "answers           1 (0 cancelled)" in text
    assert session.messages == [{"role": "user", "content": "one"}, {"role": "assistant", "content": "x"}]


def test_a_cancelled_answer_keeps_what_came_and_reports_it(run):
    backend = ScriptedBackend()
    stream = _Stream([("Once upon", False), (" a time", False)], cancel_after=1)
    stream.cancel()  # as the SIGINT handler would, before the rest arrives
    backend.answers = [stream]
    session = ChatSession(SamplingParams(), max_context=100)
    text = run(backend, "story\r\x03\x03", session)
    assert "Once upon\n[cancelled]\n" in text and "· cancelled" in text
    assert "(Ctrl-C again or Ctrl-D to leave)" in text  # the first Ctrl-C at the prompt only warns
    assert session.messages[-1] == {"role": "assistant", "content": "Once upon"}
