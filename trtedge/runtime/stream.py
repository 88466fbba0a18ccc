"""What the engine hands back: stream deltas, final outputs, metrics, and the cancellable iterator."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from trtedge.runtime.sampling import TokenLogprobs


@dataclass(frozen=True)
class StreamDelta:
    """One increment of a generation: new text, new token ids, and on the last delta the finish reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | None while running
    logprobs: list[TokenLogprobs] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0  # all output tokens, including the one sampled at prefill
    decoded_tokens: int = 0  # output tokens after the first
    time_to_first_token: float = 0.0
    prefill_time: float = 0.0
    generation_time: float = 0.0
    decode_tokens_per_second: float = 0.0
    reused_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    metrics: GenerationMetrics | None = None
    prompt_token_ids: list[int] = field(default_factory=list)


class CancellableIterator(Iterator[StreamDelta]):
    """Iterates the deltas of one request.

    ``cancel()`` may be called from any thread, including while another thread is iterating: the
    engine stops the request and the iteration ends after its final delta. ``close()`` cancels,
    drains and releases.
    """

    def __init__(self, channel: queue.Queue, cancel: Callable[[], None]):
        self._channel = channel
        self._cancel = cancel
        self._done = False
        self._lock = threading.Lock()
        self.cancelled = False

    def __iter__(self) -> CancellableIterator:
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        item = self._channel.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        with self._lock:
            if not self.cancelled:
                self.cancelled = True
                self._cancel()

    def close(self) -> None:
        self.cancel()
        try:
            for _ in self:
                pass
        except Exception:
            pass

    def __enter__(self) -> CancellableIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
