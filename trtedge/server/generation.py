"""One HTTP request's generation: the engine's deltas delivered on the event loop (batched per engine
step, for every request of the loop at once), its admission seat, and its metrics. ``close()`` cancels
whatever still runs in the engine and releases the seat, once."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from trtedge.llm import LLM
from trtedge.runtime.output import LoopBatcher, LoopChannel, RequestHandle, StreamDelta
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.server.admission import Seat
from trtedge.server.errors import APIError, engine_failure
from trtedge.server.metrics import ServerMetrics

log = logging.getLogger("trtedge.server")

_BATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its LoopBatcher


def loop_batcher(loop: asyncio.AbstractEventLoop) -> LoopBatcher:
    if loop not in _BATCHERS:
        _BATCHERS[loop] = LoopBatcher(loop)
    return _BATCHERS[loop]


@dataclass(frozen=True)
class Choice:
    """One engine request: a prompt (token ids, or a MultimodalPrompt) and its params, whose ``n`` choices
    are consecutive response choices."""

    prompt: Any
    params: SamplingParams

    @property
    def num_prompt_tokens(self) -> int:
        return len(getattr(self.prompt, "ids", self.prompt))


class Generation:
    def __init__(
        self,
        llm: LLM,
        choices: list[Choice],
        *,
        seat: Seat,
        metrics: ServerMetrics,
        request_id: str,
        priority: int,
        arrival: float,
    ):
        self._seat = seat
        self.request_id = request_id
        self._metrics = metrics
        self._arrival = arrival
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self.cancelled = False  # set once cancel() ran: the client is gone, nothing more is sent
        self.streams: list[RequestHandle] = []
        self.num_choices = sum(c.params.n for c in choices)
        self._offsets = [sum(c.params.n for c in choices[:i]) for i in range(len(choices))]
        batcher = loop_batcher(self._loop)
        try:
            for i, choice in enumerate(choices):
                channel = LoopChannel(batcher, lambda item, i=i: self._receive(i, item))
                stream = llm.generate_stream(
                    choice.prompt,
                    choice.params,
                    priority=priority,
                    request_id=f"{request_id}-p{i}",
                    channel=channel,
                )
                self.streams.append(stream)
        except BaseException:
            self.close()
            raise

    def _receive(self, index: int, item) -> None:
        """On the event loop: a delta of prompt ``index`` (or the engine's error for it)."""
        if isinstance(item, StreamDelta):
            index = self._offsets[index] + item.index
        self._queue.put_nowait((index, item))

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(response choice index, delta) in arrival order until every choice has finished; an engine
        failure is raised as its ``APIError`` (500 engine_error or 503 engine_unavailable)."""
        remaining = self.num_choices
        first_seen: set[int] = set()
        last: dict[int, float] = {}
        while remaining:
            index, item = await self._queue.get()
            if isinstance(item, APIError):
                raise item  # abandon(): the server is stopping
            if isinstance(item, BaseException):
                log.error(
                    "request %s failed in the engine: %s: %s", self.request_id, type(item).__name__, item
                )
                raise engine_failure(item) from None
            now = time.monotonic()
            if index not in first_seen:
                first_seen.add(index)
                self._metrics.ttft.observe(now - self._arrival)
            elif item.token_ids:
                self._metrics.itl.observe(now - last[index])
            last[index] = now
            if item.finish_reason is not None:
                remaining -= 1
                self._metrics.prompt_tokens.inc(item.prompt_tokens)
                self._metrics.generated_tokens.inc(item.completion_tokens)
            yield index, item

    def has_pending(self) -> bool:
        """Deltas (or an error) already wait to be read: the next ``deltas()`` item comes at once."""
        return not self._queue.empty()

    def abandon(self, error: APIError) -> None:
        """End this generation with ``error`` (the server stops at once): the engine stops working on
        it and ``deltas()`` raises ``error`` next, so a stream sends it as its last event."""
        if self._closed:
            return
        self._queue.put_nowait((0, error))
        for stream in self.streams:
            stream.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        for stream in self.streams:
            stream.cancel()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.cancel()
        self._seat.release()
