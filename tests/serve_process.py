"""`trtedge serve` as a real process on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """Starts `trtedge serve ARGS` with the embedded model and waits until /health answers."""

    def __init__(self, tmp, args: list[str]):
        from trtedge.runtime.artifacts.embedded import embedded_model_path

        try:
            embedded_model_path()
        except FileNotFoundError as e:
            pytest.skip(str(e))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The session's scratch cache (tests/conftest.py): bundles and compiled kernels built once are
        # shared by every server, in-process LLM and CLI run of the session.
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.out = tmp.mktemp("serve") / "stdout.txt"
        self.err = self.out.with_name("stderr.txt")
        command = [sys.executable, "-m", "trtedge.cli", "serve", "--port", str(self.port), *args]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"trtedge serve exited {self.proc.returncode}: {self.err.read_text()[-2000:]}"
                )
            try:
                healthy = httpx.get(f"{self.url}/health", timeout=1).status_code == 200
                if healthy and "serving http" in self.out.read_text():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("trtedge serve did not become healthy in 240 s")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
