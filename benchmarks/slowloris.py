"""Slow clients against `trtedge serve`: the latency of real requests with and without N slowloris
connections (each sends one header byte a second and never finishes), in one run.

    python benchmarks/slowloris.py [--slow 200] [--requests 20] [--url http://127.0.0.1:8000]

Without --url it starts `trtedge serve` (embedded SmolLM2) on a free port. Real requests are
/health and a 4-token completion, sent one after another; the figures are their median and worst
latency while the slow connections are open (phase "slowloris") and after they are gone ("idle"),
and how many slow connections the server had closed after its header deadline.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def _latencies(url: str, n: int) -> dict[str, list[float]]:
    out = {"health": [], "completion": []}
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    for _ in range(n):
        t = time.perf_counter()
        httpx.get(f"{url}/health", timeout=60).raise_for_status()
        out["health"].append(time.perf_counter() - t)
        t = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        out["completion"].append(time.perf_counter() - t)
    return out


def _trickle(url: str, count: int, stop: threading.Event, closed: list[int]) -> None:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    dropped = set()
    while not stop.is_set():
        for i, s in enumerate(socks):
            if i not in dropped:
                try:
                    s.sendall(b"X")
                except OSError:
                    dropped.add(i)
        closed[0] = len(dropped)
        stop.wait(1.0)
    for s in socks:
        s.close()


def _start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tempfile.mkdtemp(prefix="trtedge-slowloris-")
    env = {**os.environ, "TRTEDGE_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "trtedge.cli", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--url")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else _start_server()
    try:
        _latencies(url, 3)  # warm-up
        stop, closed = threading.Event(), [0]
        thread = threading.Thread(target=_trickle, args=(url, args.slow, stop, closed))
        thread.start()
        time.sleep(1)
        under = _latencies(url, args.requests)
        time.sleep(12)  # past the header deadline
        stop.set()
        thread.join()
        idle = _latencies(url, args.requests)
        for phase, data in (("slowloris", under), ("idle", idle)):
            for kind, values in data.items():
                print(
                    f"{phase:9} {kind:10} median {statistics.median(values) * 1000:7.1f} ms"
                    f"  max {max(values) * 1000:7.1f} ms  ({len(values)} requests)"
                )
        print(f"slow connections closed by the server: {closed[0]} of {args.slow}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
