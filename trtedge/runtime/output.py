"""What the engine hands back: stream deltas, final outputs, metrics, and the cancellable iterator."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from trtedge.runtime.executor.sampler import TokenLogprobs
from trtedge.runtime.text.streaming import held_back
from trtedge.runtime.text.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)  # not frozen: a frozen init costs ~4x, one of these a token
class StreamDelta:
    """One increment of a generation: new text, new token ids, and on the last delta the finish reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | None while running
    logprobs: list[TokenLogprobs] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of this choice so far
    index: int = 0  # which of the request's n choices this delta belongs to
    cached_tokens: int = 0  # prompt tokens taken from the context cache (context reuse)
    # on a choice's first delta when asked for: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # the last token ended the choice as a stop token (EOS, a stop_token_ids entry, the guide's end):
    # its text is not part of ``text``
    stop_token: bool = False


class TextStream:
    """One choice's output text, made where its deltas are consumed (the engine thread in process; the
    client's output thread beside an engine core process): incremental detokenization, and the text
    held back while it could still be the start of a stop string, cut at the first stop string."""

    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool, stops: list[str] | None):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stops = stops or []
        self.pending = ""  # text held back: could be the start of a stop string

    def step(self, token: int, shown: bool, final: bool) -> tuple[str, bool]:
        """The text that ``token`` completes (none when not ``shown``: a stop token such as EOS) and,
        when ``final``, all that was held back; True when a stop string ended the text (cut before it)."""
        text = self._detok.add(token) if shown else ""
        if final:
            text += self._detok.flush()
        if not self._stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        if final:
            self.pending = ""
            return buf, False
        hold = held_back(buf, *self._stops)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False


@dataclass
class GenerationMetrics:
    """Timings and counts of one request, handed to ``on_metrics`` once when it ends. With ``n > 1`` the
    token counts add up all choices and ``finish_reason`` is choice 0's (or "cancelled" / "error")."""

    prompt_tokens: int = 0
    generated_tokens: int = 0  # all output tokens, including the one sampled at prefill
    decoded_tokens: int = 0  # output tokens after the first
    time_to_first_token: float = 0.0
    prefill_time: float = 0.0
    generation_time: float = 0.0
    decode_tokens_per_second: float = 0.0
    reused_tokens: int = 0
    finish_reason: str | None = None
    # speculative decoding (zero without it): draft tokens scored, accepted, verification steps,
    # accepted / drafted, tokens emitted per step (accepted + bonus), seconds drafting and verifying
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_proposal_time: float = 0.0
    spec_verification_time: float = 0.0
    forward_passes: int = 0  # model steps that computed tokens of this request (prefill chunks included)
    jump_forward_tokens: int = 0  # output tokens taken from a jump-forward draft, without a pass of their own


@dataclass
class CompletionOutput:
    """One of a request's ``n`` independent choices."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """The result of one request. ``text``, ``token_ids``, ``finish_reason`` and ``logprobs`` are those of
    choice 0; ``outputs`` holds all ``n`` choices; ``completion_tokens`` counts the tokens of all of them."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    metrics: GenerationMetrics | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    # with SamplingParams(prompt_logprobs=k): per prompt token (the first: None) its logprob, rank and top k
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class CancellableIterator(Iterator[StreamDelta]):
    """Iterates the deltas of one request.

    ``cancel()`` may be called from any thread, including while another thread is iterating: the
    engine stops the request, frees its seat and KV blocks, and the iteration ends after the final
    delta (``finish_reason="cancelled"``). ``close()`` cancels, drains and releases. With ``n > 1``
    the choices' deltas interleave (``StreamDelta.index``) and the iteration ends after all
    ``n`` final deltas.
    """

    def __init__(self, channel: queue.Queue, cancel: Callable[[], None], num_choices: int = 1):
        self._channel = channel
        self._cancel = cancel
        self._num_open = num_choices
        self._done = False
        self._lock = threading.Lock()
        self.cancelled = False

    def __iter__(self) -> CancellableIterator:
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        item = self._channel.get()
        if item is _END:  # another thread consumed the end
            self._end()
            raise StopIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finish_reason is not None:
            with self._lock:
                self._num_open -= 1
                last = self._num_open == 0
            if last:
                self._end()
        return item

    def _end(self) -> None:
        # Leave a marker so that a thread blocked in __next__ (or close() draining beside it) wakes up.
        self._done = True
        self._channel.put(_END)

    def cancel(self) -> None:
        with self._lock:
            if not self.cancelled:
                self.cancelled = True
                self._cancel()

    def close(self) -> None:
        if not self._done:
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

    def __del__(self) -> None:
        if not self._done and not self.cancelled:  # dropped mid-stream: stop generating for nobody
            self._cancel()


_END = object()


class LoopBatcher:
    """Hands an event loop the deltas of every request of one engine step in one wake-up: the engine
    thread ``put``s them during the step and ``flush``es once after it (a wake-up per token and a
    thread per request cost an HTTP server more than the model did)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable, object]] = []

    def put(self, deliver: Callable, item) -> None:
        with self._lock:
            self._pending.append((deliver, item))

    def flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        if items:
            try:
                self._loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # the loop is closed: nobody reads these any more
                pass


def _deliver_all(items) -> None:
    for deliver, item in items:
        deliver(item)


class LoopChannel:
    """A request's output channel that calls ``deliver(item)`` on the batcher's event loop, for each
    ``StreamDelta`` and for an engine error (an exception)."""

    def __init__(self, batcher: LoopBatcher, deliver: Callable):
        self.batcher = batcher
        self._deliver = deliver

    def put(self, item) -> None:
        self.batcher.put(self._deliver, item)


class RequestHandle:
    """What ``submit`` returns for a request whose deltas go to a ``LoopChannel``: it cancels, and (for a
    consumer that makes the text itself) stops one choice at a stop string."""

    def __init__(self, cancel: Callable[[], None], stop: Callable[[int, int], None] | None = None):
        self._cancel = cancel
        self._stop = stop
        self.cancelled = False

    def stop_choice(self, index: int, num_output_tokens: int) -> None:
        """Finish choice ``index`` with reason "stop" after its first ``num_output_tokens`` tokens (a stop
        string ended its text there); tokens it made past them are dropped."""
        if self._stop is not None:
            self._stop(index, num_output_tokens)

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._cancel()

    close = cancel
