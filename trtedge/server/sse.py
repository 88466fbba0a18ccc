"""Server-sent events and client-disconnect detection.

``SSEResponse`` streams pre-encoded events; ``DisconnectWatcher`` listens for the ASGI
``http.disconnect`` message so that generation is cancelled the moment a client goes away,
whether it was waiting in the queue, reading a stream or waiting for a whole answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.types import Receive, Scope, Send

log = logging.getLogger("trtedge.server")

DONE = b"data: [DONE]\n\n"
_MAX_JOINED = 64  # events at most in one write of a stream that is behind


def event(data: dict, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class DisconnectWatcher:
    """Reads ``receive`` until ``http.disconnect``; then sets ``gone`` and runs the callbacks once.
    Start it after the request body has been read."""

    def __init__(self, receive: Receive):
        self.gone = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self.gone.set()
        for callback in self._callbacks:
            callback()

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def stop(self) -> None:
        self._task.cancel()


class SSEResponse:
    """An ASGI response that sends each event as it comes and calls ``on_close`` exactly once at the
    end, however it ends (finished, client gone, error, or never started)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], None],
        media_type: str = "text/event-stream; charset=utf-8",
        ready: Callable[[], bool] | None = None,
    ):
        self.events = events
        self.on_close = on_close
        self.media_type = media_type  # another for a raw stream (speech audio)
        # True while the next events are already waiting (the stream is behind the engine): they are
        # joined into one write, so a busy server pays one send per burst instead of one per token
        self.ready = ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", self.media_type.encode()),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            pending: list[bytes] = []
            async for chunk in self.events:
                pending.append(chunk)
                if self.ready is not None and self.ready() and len(pending) < _MAX_JOINED:
                    continue
                body = pending[0] if len(pending) == 1 else b"".join(pending)
                pending = []
                await send({"type": "http.response.body", "body": body, "more_body": True})
            if pending:
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            log.debug("client disconnected during a stream")
        finally:
            try:
                await self.events.aclose()
            finally:
                self.on_close()
