"""The real coding-agent CLIs against `trtedge serve` on the embedded models, configured as
docs/claude-code.md and docs/codex.md say: `claude -p` and `codex exec` exit 0 and print the text
the model wrote (read from the answers, through tests/e2e/agent_proxy.py).

The CLIs come from scripts/install-agents.sh (pinned versions, into .agents/); without them the tests
skip. They run in temporary homes: nothing of the user's configuration or history is read or written.
The default run uses the docs' small-model setup (a short system prompt; Claude Code with one tool,
Codex without its subagent and goal tools) on SmolLM2, and the CLIs' full default prompts (9-12.5k
tokens), which SmolLM2's 8k window refuses at once; the slow tests run them all on Gemma 3 270M (32k)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".agents" / "node_modules" / ".bin"
KEY = "my-local-key"
# The docs' small-model setup: greedy, bounded answers; each model's own context window. Gemma 3 270M
# is a base model: greedy, it repeats the prompt and loops in a tool's description (past 3,800 tokens
# without an end); a repetition penalty makes it end its turn.
GENERATION = {
    "smollm2": '{"temperature": 0, "max_new_tokens": 256}',
    "gemma3": '{"temperature": 0, "max_new_tokens": 4096, "repetition_penalty": 1.3}',
}
CONTEXT = {
    "smollm2": ["--max-kv-cache-capacity", "8192", "--max-input-len", "7168"],
    "gemma3": ["--max-kv-cache-capacity", "32768", "--max-input-len", "28672"],
}
SYSTEM_PROMPT = "You are a helpful assistant. Answer in one short sentence."
PROMPT = "Say hello"


def cli(name: str) -> Path:
    path = BIN / name
    if not path.exists() or shutil.which("node") is None:
        pytest.skip(f"the {name} CLI is not installed: run scripts/install-agents.sh")
    return path


# Gemma 3 270M as packaged is a base model: greedy, it echoes the prompt (~1,000 tokens) before it ends
# its turn, minutes of decoding on a CPU, so it runs with the slow tests.
@pytest.fixture(scope="module", params=["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def server(request, tmp_path_factory):
    model = [str(request.getfixturevalue("gemma3_gguf"))] if request.param == "gemma3" else []
    args = [*model, "--enable-auto-tool-choice", "--served-model-name", "local", "--api-key", KEY]
    args += [*CONTEXT[request.param], "--override-generation-config", GENERATION[request.param]]
    serve = ServeProcess(tmp_path_factory, args)
    serve.model = request.param
    yield serve
    serve.stop()


@pytest.fixture
def proxy(server, tmp_path):
    """The agent proxy in front of the server: its directory holds every request and answer. It forwards
    the requests anonymised, so that the prompt (Claude Code writes the working directory, the OS version
    and the date into it) is the same on every machine: a path longer by a few tokens turned SmolLM2's
    greedy "Say hello" answer into 6,000 tokens of rambling."""
    port = free_port()
    out = tmp_path / "capture"
    command = [sys.executable, "-m", "tests.e2e.agent_proxy", "--upstream", server.url]
    command += ["--port", str(port), "--out", str(out), "--forward-anonymised"]
    command += ["--replace", f"{workdir_path(tmp_path)}=/home/user/project"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the agent proxy did not start") from None
            time.sleep(0.2)
    yield url, out
    proc.terminate()
    proc.wait(timeout=30)


def isolated_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(home), "LANG": "C.UTF-8"}
    return {**env, **extra}


def workdir_path(tmp_path: Path) -> Path:
    return tmp_path / "project"


def workdir(tmp_path: Path) -> Path:
    project = workdir_path(tmp_path)
    project.mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)  # codex exec works in a repository
    return project


def sent(capture: Path, path: str) -> list[dict]:
    """The bodies of the requests the CLI sent to ``path``, in order."""
    records = [json.loads(p.read_text()) for p in sorted(capture.glob("*.json"))]
    return [r["body"] for r in records if r["path"].split("?")[0] == path]


def answered_text(capture: Path, kind: str) -> str:
    """The text of the last successful answer, joined from its streamed deltas."""
    for answer in sorted(capture.glob("*.answer"), reverse=True):
        status, _, body = answer.read_text().partition("\n")
        if status != "200" or "data: " not in body:
            continue
        text = []
        for line in body.splitlines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if kind == "anthropic" and event.get("delta", {}).get("type") == "text_delta":
                text.append(event["delta"]["text"])
            if kind == "responses" and event["type"] == "response.output_text.delta":
                text.append(event["delta"])
        return "".join(text)
    raise AssertionError(f"no successful answer in {sorted(p.name for p in capture.iterdir())}")


def run(command: list, env: dict, cwd: Path, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    return result, time.monotonic() - start


def claude_env(tmp_path: Path, base_url: str) -> dict[str, str]:
    # docs/claude-code.md, section 2
    return isolated_env(
        tmp_path,
        CLAUDE_CONFIG_DIR=str(tmp_path / "claude"),
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_AUTH_TOKEN=KEY,
        ANTHROPIC_MODEL="local",
        ANTHROPIC_DEFAULT_OPUS_MODEL="local",
        ANTHROPIC_DEFAULT_SONNET_MODEL="local",
        ANTHROPIC_DEFAULT_HAIKU_MODEL="local",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )


def codex_home(tmp_path: Path, base_url: str, small: bool) -> Path:
    # docs/codex.md, section 2 (and its small-model settings)
    home = tmp_path / "codex"
    home.mkdir()
    lines = []
    if small:
        (home / "instructions.md").write_text(SYSTEM_PROMPT + "\n")
        lines += [
            f'model_instructions_file = "{home / "instructions.md"}"',
            "include_environment_context = false",
        ]
    lines += [
        'model = "local"',
        'model_provider = "trtedge"',
        "",
        "[model_providers.trtedge]",
        'name = "trtedge"',
        f'base_url = "{base_url}/v1"',
        'env_key = "TRTEDGE_API_KEY"',
        'wire_api = "responses"',
        "stream_idle_timeout_ms = 1800000",
    ]
    if small:  # the subagent namespace and the goal tools are ~60% of the tools' tokens
        lines += ["", "[agents]", "enabled = false", "", "[features]", "goals = false"]
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    return home


def exchanges(capture: Path) -> list[str]:
    """One line per request the CLI sent: path, status, prompt and output tokens of the answer."""
    lines = []
    for answer in sorted(capture.glob("*.answer")):
        status, _, body = answer.read_text().partition("\n")
        path = json.loads(answer.with_suffix(".json").read_text())["path"]
        usage: dict = {}
        for line in body.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                inner = event.get("message", event.get("response"))
                usage.update((inner if isinstance(inner, dict) else event).get("usage") or {})
        if body.startswith("{"):
            usage = json.loads(body).get("usage") or {"error": json.loads(body).get("error")}
        lines.append(f"{path} {status} {json.dumps(usage)[:300]}")
    return lines


def report(result: subprocess.CompletedProcess, capture: Path, wall: float) -> None:
    """The command, its exit status, what it printed and the requests it sent (shown with -rP)."""
    print(f"{' '.join(map(str, result.args))}\n-> exit {result.returncode} in {wall:.0f} s")
    print(f"stdout: {result.stdout.strip()!r}\nstderr tail: {result.stderr.strip()[-600:]!r}")
    print("\n".join(exchanges(capture)))


def check(result: subprocess.CompletedProcess, capture: Path, kind: str, wall: float) -> None:
    report(result, capture, wall)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    text = answered_text(capture, kind).strip()
    assert text, "the model's answer was empty"
    assert text in result.stdout, f"the CLI printed {result.stdout!r}, the model wrote {text!r}"


def refused(capture: Path) -> dict:
    """The error of the one answer the CLI got (a 400)."""
    [answer] = [a for a in capture.glob("*.answer") if "_v1_" in a.name]
    status, _, body = answer.read_text().partition("\n")
    assert status == "400", body
    return json.loads(body)["error"]


def test_claude_code_prints_the_models_answer(proxy, tmp_path):
    url, capture = proxy
    command = [cli("claude"), "-p", "--tools", "Read", "--system-prompt", SYSTEM_PROMPT, PROMPT]
    result, wall = run(command, claude_env(tmp_path, url), workdir(tmp_path), timeout=900)
    check(result, capture, "anthropic", wall)
    first = sent(capture, "/v1/messages")[0]
    assert [t["name"] for t in first["tools"]] and first["stream"] is True


def test_codex_prints_the_models_answer(proxy, tmp_path):
    url, capture = proxy
    env = isolated_env(tmp_path, CODEX_HOME=str(codex_home(tmp_path, url, small=True)), TRTEDGE_API_KEY=KEY)
    result, wall = run([cli("codex"), "exec", PROMPT], env, workdir(tmp_path), timeout=1200)
    check(result, capture, "responses", wall)
    kinds = {t["type"] for t in sent(capture, "/v1/responses")[-1]["tools"]}
    assert "web_search" in kinds  # a hosted tool: left out of the prompt, not refused


# SmolLM2's 8k window cannot hold either CLI's default prompt: both say so in their own words at once
# (the server's errors are worded as each API words them). Gemma 3 270M's 32k holds them: minutes of
# prefill on a CPU.
def test_claude_code_with_its_full_default_prompt(server, proxy, tmp_path):
    url, capture = proxy
    env, cwd = claude_env(tmp_path, url), workdir(tmp_path)
    result, wall = run([cli("claude"), "-p", PROMPT], env, cwd, timeout=3600)
    if server.model == "gemma3":
        return check(result, capture, "anthropic", wall)
    report(result, capture, wall)
    error = refused(capture)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ") and error["message"].endswith(
        " > 7168 maximum"
    )
    assert result.returncode == 1 and result.stdout.startswith("Prompt is too long")


def test_codex_with_its_full_default_prompt(server, proxy, tmp_path):
    url, capture = proxy
    env = isolated_env(tmp_path, CODEX_HOME=str(codex_home(tmp_path, url, small=False)), TRTEDGE_API_KEY=KEY)
    result, wall = run([cli("codex"), "exec", PROMPT], env, workdir(tmp_path), timeout=3600)
    if server.model == "gemma3":
        check(result, capture, "responses", wall)
        kinds = {t["type"] for t in sent(capture, "/v1/responses")[-1]["tools"]}
        assert {"namespace", "web_search"} <= kinds  # served and left out, not refused
        return
    report(result, capture, wall)
    assert refused(capture)["code"] == "context_length_exceeded"
    assert result.returncode == 1 and "ran out of room in the model's context window" in result.stderr
