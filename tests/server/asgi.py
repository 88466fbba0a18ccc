"""Drive an ASGI app directly: streamed chunks as they come, and a client that can hang up."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The ``data:`` payloads of an SSE body, in order."""
        return [line[6:] for line in self.body.decode().split("\n") if line.startswith("data: ")]


async def call(
    app,
    path: str,
    body=None,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    hang_up: asyncio.Event | None = None,
    on_chunk=None,
) -> Reply:
    """One request. The client hangs up (``http.disconnect``) when ``hang_up`` is set."""
    reply = Reply()
    payload = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = False
    hang_up = hang_up or asyncio.Event()
    done = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        waiters = [asyncio.ensure_future(hang_up.wait()), asyncio.ensure_future(done.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                reply.chunks.append(message["body"])
                if on_chunk is not None:
                    on_chunk(reply)
            if not message.get("more_body"):
                done.set()

    raw_headers = [(b"content-type", b"application/json")]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw_headers,
        "server": ("testserver", 80),
        "client": ("testclient", 1234),
    }
    await app(scope, receive, send)
    done.set()
    return reply


async def wait_for(predicate, timeout: float = 30.0, interval: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
