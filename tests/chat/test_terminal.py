"""`trtedge chat` as a real process: the TUI in a pseudo-terminal (pexpect), --url against a
`trtedge serve` started here, and piped stdin. All on the embedded SmolLM2 with short answers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.serve_process import ServeProcess

pexpect = pytest.importorskip("pexpect")

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[=>]|[\x08\r]")
LAUNCH = ["--max-kv-cache-capacity", "1024", "--max-input-len", "512"]
GREEDY = ["--temperature", "0", "--max-tokens", "24"]
PROMPT = r"\n>"  # prompt-toolkit draws "> " as ">" plus a cursor move


@pytest.fixture(scope="module")
def embedded():
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


class Terminal:
    """A child in a 100x40 xterm; ``wait`` matches regexes against the output with escapes stripped."""

    def __init__(self, args: list[str], tmp_path, **extra_env: str):
        env = {
            **os.environ,
            **extra_env,
            "TERM": "xterm",
            "COLUMNS": "100",
            "LINES": "40",
            "PROMPT_TOOLKIT_NO_CPR": "1",
            "TRTEDGE_CHAT_HISTORY": str(tmp_path / "history"),
            "HF_HUB_OFFLINE": "1",
        }
        self.child = pexpect.spawn(
            sys.executable, ["-m", "trtedge.cli", "chat", *args], env=env, dimensions=(40, 100), timeout=5
        )
        self.raw = ""
        self.pos = 0

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def wait(self, pattern: str, timeout: float = 60) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = regex.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            if time.monotonic() > deadline or not self.child.isalive() and not self._read(0):
                raise AssertionError(f"no {pattern!r} in:\n{self.text[self.pos :][-3000:]}")
            self._read(0.2)

    def _read(self, timeout: float) -> bool:
        try:
            self.raw += self.child.read_nonblocking(65536, timeout=timeout).decode(errors="replace")
            return True
        except (pexpect.TIMEOUT, pexpect.EOF):
            return False

    def type(self, line: str) -> None:
        self.child.send(line + "\r")

    def close(self) -> int | None:
        deadline = time.monotonic() + 30
        while self.child.isalive() and time.monotonic() < deadline:
            self._read(0.2)
        self._read(0)
        if self.child.isalive():
            self.child.terminate(force=True)
        self.child.close()
        return self.child.exitstatus


def test_interactive_session_streams_measures_validates_cancels_and_exits(embedded, tmp_path):
    term = Terminal([*GREEDY, *LAUNCH], tmp_path)
    try:
        term.wait(r"trtedge chat · SmolLM2", timeout=240)
        term.wait(PROMPT)
        term.type("What is the capital\x1b\rof France?")  # Alt-Enter: a new line, not a send
        term.wait(r"Paris")
        metrics_line = r"TTFT \d+.*tok/s · \d+ tokens · latency .* · context \d+/1024 \(\d+%\)[^\n]*"
        assert "cancelled" not in term.wait(metrics_line).group(0)
        term.wait(PROMPT)

        term.type("/params temperature=-1")
        term.wait(r"error: /params: temperature must be >= 0")
        term.wait(PROMPT)

        term.type("/params max_tokens=400")
        term.wait(r"params: max_tokens=400")
        term.wait(PROMPT)
        term.type("Write a very long story about a dragon who learns to fly.")
        term.wait(r"\n[^\n>]{40,}", timeout=60)  # the answer is streaming
        term.child.sendintr()
        term.wait(r"\[cancelled\]", timeout=30)
        cancelled = term.wait(r"tok/s · (\d+) tokens .*· cancelled")
        assert int(cancelled.group(1)) < 400
        term.wait(PROMPT)

        term.type("/stats")
        term.wait(r"answers\s+2 \(1 cancelled\)")
        term.wait(PROMPT)
        term.child.sendintr()  # at the prompt: once warns, it does not leave
        term.wait(r"Ctrl-C again or Ctrl-D")
        term.type("/exit")
        term.wait(r"bye")
    finally:
        status = term.close()
    assert status == 0
    history = (tmp_path / "history").read_text()
    assert "+What is the capital\n+of France?" in history and "/params max_tokens=400" in history


def test_the_first_chat_on_an_empty_cache_says_it_builds_the_bundle_once_and_how_long_it_took(
    embedded, tmp_path
):
    term = Terminal([*GREEDY, *LAUNCH], tmp_path, TRTEDGE_CACHE_DIR=str(tmp_path / "cache"))
    try:
        term.wait(r"building the bundle for this model \(once", timeout=240)
        seconds = term.wait(r"built the bundle once in (\d+\.\d) s; later launches", timeout=240)
        assert float(seconds.group(1)) > 0
        term.wait(r"trtedge chat · SmolLM2")
        term.wait(PROMPT)
        term.type("/exit")
        term.wait(r"bye")
    finally:
        status = term.close()
    assert status == 0
    assert any((tmp_path / "cache" / "bundles").iterdir())


@pytest.fixture(scope="module")
def server(embedded, tmp_path_factory):
    server = ServeProcess(tmp_path_factory, [*LAUNCH, "--log-level", "warning"])
    yield server.url
    server.stop()


def test_url_mode_chats_with_a_running_server(server, tmp_path):
    term = Terminal(["--url", server, *GREEDY], tmp_path)
    try:
        term.wait(r"trtedge chat · SmolLM2.* · http://127\.0\.0\.1:\d+ · context 1024 tokens", timeout=60)
        term.wait(PROMPT)
        term.type("What is the capital of France?")
        term.wait(r"Paris")
        term.wait(r"TTFT .* tok/s · \d+ tokens · latency .* · context \d+/1024")
        term.wait(PROMPT)
        term.type("/retry")
        term.wait(r"Paris")
        term.wait(r"TTFT .* tok/s")
        term.wait(PROMPT)
        term.type("/stats")
        term.wait(r"answers\s+2 \(0 cancelled\)")
        term.wait(PROMPT)
        term.type("/model")
        term.wait(r"server\s+http://127\.0\.0\.1")
        term.wait(PROMPT)
        term.child.sendeof()  # Ctrl-D leaves
        term.wait(r"bye")
    finally:
        status = term.close()
    assert status == 0


def test_a_one_shot_answer_cut_by_ctrl_c_exits_130(server, tmp_path):
    prompt = "Write a very long story about a dragon who learns to fly."
    term = Terminal(["--url", server, "-p", prompt, "--temperature", "0", "--max-tokens", "400"], tmp_path)
    try:
        term.wait(r"[^\n]{40,}", timeout=60)  # the answer is streaming
        term.child.sendintr()
    finally:
        status = term.close()
    assert status == 130, term.text[-2000:]
    assert "Traceback" not in term.text


def test_url_mode_with_piped_stdin(server):
    proc = subprocess.run(
        [sys.executable, "-m", "trtedge.cli", "chat", "--url", f"{server}/v1", *GREEDY],
        input="What is the capital of France?",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_piped_stdin_is_one_prompt(embedded):
    proc = subprocess.run(
        [sys.executable, "-m", "trtedge.cli", "chat", *GREEDY, *LAUNCH],
        input="What is the capital\nof France?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "\x1b[" not in proc.stdout  # plain text for scripts
