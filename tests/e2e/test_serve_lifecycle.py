"""`trtedge serve`'s lifecycle as a process: a bad address fails before the model loads; the first
Ctrl-C drains (new requests get 503 shutting_down), the second ends what is left and exits 130."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from tests.serve_process import ServeProcess

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def _serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRTEDGE_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "trtedge.cli", "serve", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_a_taken_port_exits_2_naming_the_port_before_loading_the_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve(tmp_path, "--port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"--port {port}" in r.stderr and "already in use" in r.stderr
    assert "Using the embedded default model" not in r.stdout  # it never got as far as the model
    assert not (tmp_path / "cache").exists()


def test_an_address_not_on_this_machine_exits_2_naming_the_host(tmp_path):
    r = _serve(tmp_path, "--host", "192.0.2.1", "--api-key", "k")  # TEST-NET-1: never a local address
    assert r.returncode == 2, r.stderr
    assert "--host '192.0.2.1'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cache").exists()


@pytest.fixture
def server(tmp_path_factory):
    # the default build profile: the bundle test_http_examples' server and one-shot chats use too
    server = ServeProcess(tmp_path_factory, ["--log-level", "warning"])
    yield server
    server.stop()


def _wait_for(path, text: str) -> None:
    while text not in path.read_text():
        threading.Event().wait(0.05)


def test_ctrl_c_drains_with_503_then_a_second_ctrl_c_ends_the_stream_with_done_and_exits_130(server):
    body = {"messages": PARIS, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"role":"assistant"' in first
        server.proc.send_signal(signal.SIGINT)
        _wait_for(server.out, "draining 1 active")
        during = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        ready = httpx.get(f"{server.url}/health/ready", timeout=30)
        server.proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line.startswith(("data: ", "event: "))]
    assert during.status_code == 503 and during.json()["error"]["code"] == "shutting_down"
    assert ready.status_code == 503
    assert rest[-1] == "data: [DONE]"
    assert rest[-3] == "event: error"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=60) == 130
    err = server.err.read_text()
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    assert "stopped at once" in server.out.read_text()
