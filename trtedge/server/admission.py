"""Admission: who may generate now, who waits, who gets 429.

Without in-flight batching one request generates at a time and up to ``max_waiting`` wait for it,
highest priority first then first come, each for at most ``timeout`` seconds. With in-flight
batching the engine schedules, so the server only bounds what is in flight (batch + queue) and
refuses the next at once. Either way a ``Seat`` is taken before the response starts and released
exactly once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass

from trtedge.server.errors import overloaded, shutting_down


@dataclass
class AdmissionStats:
    admitted: int = 0
    refused_queue_full: int = 0
    refused_queue_timeout: int = 0
    left_queue: int = 0  # clients that disconnected while waiting


class Seat:
    def __init__(self, admission: Admission):
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release()


class Admission:
    def __init__(self, slots: int, max_waiting: int, timeout: float):
        self.slots = slots
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.num_active = 0
        self.stats = AdmissionStats()
        self.draining = False
        self._waiters: list[list] = []  # heap of [-priority, arrival order, future]
        self._order = itertools.count()

    @classmethod
    def for_engine(
        cls, in_flight_batching: bool, max_batch_size: int, max_queued: int, timeout: float
    ) -> Admission:
        if in_flight_batching:
            return cls(max_batch_size + max_queued, 0, timeout)
        return cls(1, max_queued, timeout)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, priority: int = 0, abort: asyncio.Event | None = None) -> Seat:
        """A seat, or ``APIError`` 429 (full, or waited past the timeout) / 503 (draining).
        Setting ``abort`` (the client went away) leaves the queue with ``asyncio.CancelledError``."""
        if self.draining:
            raise shutting_down()
        if self.num_active < self.slots and not self._waiters:
            return self._seat()
        if len(self._waiters) >= self.max_waiting:
            self.stats.refused_queue_full += 1
            if self.max_waiting == 0 and self.slots > 1:
                why = f"{self.slots} requests are in flight (max batch size + max queued requests)"
            else:
                why = f"the queue is full ({self.max_waiting} waiting for the running request)"
            raise overloaded(f"server overloaded: {why}; retry later", retry_after=1)
        future = asyncio.get_running_loop().create_future()
        entry = [-priority, next(self._order), future]
        heapq.heappush(self._waiters, entry)
        waits = {future}
        abort_task = asyncio.ensure_future(abort.wait()) if abort is not None else None
        if abort_task is not None:
            waits.add(abort_task)
        try:
            await asyncio.wait(waits, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._leave(entry)
            raise
        finally:
            if abort_task is not None:
                abort_task.cancel()
        if future.done() and not future.cancelled():
            future.result()  # raises what refuse_waiting() gave it
            return Seat(self)
        self._leave(entry)
        if abort is not None and abort.is_set():
            self.stats.left_queue += 1
            raise asyncio.CancelledError("client disconnected while queued")
        self.stats.refused_queue_timeout += 1
        raise overloaded(
            f"server overloaded: waited {self.timeout:g}s (--queue-timeout) in the queue; retry later",
            retry_after=max(1, int(self.timeout)),
        )

    def refuse_waiting(self, error: Exception) -> None:
        """Every request waiting in the queue leaves it with ``error`` (the server stops at once)."""
        for entry in self._waiters:
            if not entry[2].done():
                entry[2].set_exception(error)
        self._waiters.clear()

    def _seat(self) -> Seat:
        self.num_active += 1
        self.stats.admitted += 1
        return Seat(self)

    def _leave(self, entry: list) -> None:
        future = entry[2]
        if future.done() and not future.cancelled():
            self._release()  # the seat was handed over as we gave up: pass it on
        else:
            future.cancel()
        if entry in self._waiters:
            self._waiters.remove(entry)
            heapq.heapify(self._waiters)

    def _release(self) -> None:
        self.num_active -= 1
        while self._waiters and self.num_active < self.slots:
            future = heapq.heappop(self._waiters)[2]
            if not future.done():
                self.num_active += 1
                self.stats.admitted += 1
                future.set_result(None)
