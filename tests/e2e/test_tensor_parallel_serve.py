"""`trtedge serve --tensor-parallel-size 2` as a real process on the CPU (gloo): the same greedy answer
as one process, then a worker killed: 503, not a hang. Slow (two servers, process spawns)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ServeProcess
from tests.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

BODY = {"prompt": [1, 5, 9, 33, 200], "max_tokens": 8, "temperature": 0}


def _workers(pid: int) -> list[int]:
    """The worker ranks under the server."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return [
        c for c in found if b"trtedge.runtime.executor.tp_worker" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def _complete(server: ServeProcess, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": model}, timeout=60)


def test_served_tp2_matches_tp1_and_a_dead_worker_is_503(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tp-serve") / "llama", "llama"))
    args = [path, "--max-kv-cache-capacity", "256", "--max-input-len", "128", "--log-level", "warning"]
    one = ServeProcess(tmp_path_factory, args)
    try:
        expected = _complete(one, path).json()["choices"][0]["text"]
    finally:
        one.stop()
    two = ServeProcess(tmp_path_factory, [*args, "--tensor-parallel-size", "2"])
    try:
        assert _complete(two, path).json()["choices"][0]["text"] == expected
        workers = _workers(two.proc.pid)
        assert workers, "no worker process under the server"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        reply = _complete(two, path)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{two.url}/health", timeout=10).status_code == 503
    finally:
        assert two.stop() is not None
