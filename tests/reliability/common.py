"""Helpers shared by the reliability tests and the stress runs: error shapes, metrics, SSE."""

from __future__ import annotations

import json
import re

import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/home/|/work/|/tmp/|site-packages")


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """The documented error shape: {"error": {"message", "type", "param", "code"}}, with no internals."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert code is None or error["code"] == code, body
    assert not LEAKS.search(response.text), response.text
    return error


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of an SSE body."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append((name, data))
    return events


def stream_error(text: str) -> dict | None:
    """The error of an SSE body that ended with an error event then [DONE] (None if it has none)."""
    events = sse_events(text)
    assert events and events[-1][1] == "[DONE]", text[-500:]
    errors = [json.loads(data)["error"] for name, data in events if name == "error"]
    assert len(errors) <= 1
    return errors[0] if errors else None


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of /metrics (gauges), by name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
