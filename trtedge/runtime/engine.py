"""The engine: one thread owns the model and the KV cache and runs
schedule -> run model -> sample -> emit deltas. Other threads submit and cancel through
thread-safe queues and read per-request output channels."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trtedge.runtime.kv_cache import BlockManager
from trtedge.runtime.runner import ModelRunner
from trtedge.runtime.sampling import Sampler, TokenLogprobs
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.scheduler import Scheduler, SchedulerConfig
from trtedge.runtime.sequence import Sequence
from trtedge.runtime.stream import CancellableIterator, GenerationMetrics, StreamDelta
from trtedge.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("trtedge")


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 1
    max_kv_cache_capacity: int = 8192
    max_num_batched_tokens: int = 2048
    enable_in_flight_batching: bool = False
    block_size: int = 16
    enable_context_reuse: bool = False
    context_cache_max_records: int = 1024
    num_blocks: int | None = None  # default: max_batch_size x max_kv_cache_capacity tokens


@dataclass
class EngineStats:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    joined_mid_flight: int = 0
    preemptions: int = 0
    steps: int = 0


@dataclass
class _Request:
    seq: Sequence
    channel: queue.Queue
    detok: IncrementalDetokenizer
    on_metrics: Callable[[GenerationMetrics], None] | None
    pending: str = ""  # text held back: could be the start of a stop string
    submitted: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        self.config = config
        self.tokenizer = tokenizer
        num_blocks = config.num_blocks or config.max_batch_size * -(
            -config.max_kv_cache_capacity // config.block_size
        )
        self.blocks = BlockManager(
            num_blocks,
            config.block_size,
            enable_reuse=config.enable_context_reuse,
            max_records=config.context_cache_max_records,
        )
        sched = SchedulerConfig(
            max_batch_size=config.max_batch_size,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.block_size),
            enable_in_flight_batching=config.enable_in_flight_batching,
        )
        self.scheduler = Scheduler(sched, self.blocks)
        self.runner = ModelRunner(model, num_blocks, config.block_size, Sampler(tokenizer.eos_token_ids))
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[int, _Request] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._rng = random.Random(0)  # unseeded requests repeat across runs when served alone
        self._rng_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="trtedge-engine", daemon=True)
        self._thread.start()

    # ---- called from any thread -------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        on_metrics: Callable[[GenerationMetrics], None] | None = None,
        request_id: str | None = None,
    ) -> CancellableIterator:
        if self.error is not None:
            raise RuntimeError(f"engine failed: {self.error}")
        seq = Sequence(prompt_ids, params, priority, request_id)
        if params.seed is None:
            with self._rng_lock:
                seq.seed = self._rng.getrandbits(64)
        channel: queue.Queue = queue.Queue()
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        request = _Request(seq, channel, detok, on_metrics)
        self._inbox.put(("add", request))
        self._wake.set()
        return CancellableIterator(channel, lambda: self.cancel(seq.seq_id))

    def cancel(self, seq_id: int) -> None:
        self._inbox.put(("cancel", seq_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_active(self) -> int:
        return len(self._requests)

    # ---- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.scheduler.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # fail the requests in flight, keep serving new ones
                log.exception("engine step failed")
                for request in list(self._requests.values()):
                    self._fail(request, e)
        for request in list(self._requests.values()):
            self._fail(request, RuntimeError("engine shut down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._requests[item.seq.seq_id] = item
                self.scheduler.add(item.seq)
                self.stats.submitted += 1
            elif kind == "cancel" and item in self._requests:
                request = self._requests[item]
                self.stats.cancelled += 1
                self._finish(request, "cancelled")

    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.stats.steps += 1
        self.stats.joined_mid_flight += batch.joined
        self.stats.preemptions += len(batch.preempted)
        if batch.is_empty:
            return
        now = time.monotonic()
        for seq in batch.seqs:
            request = self._requests[seq.seq_id]
            if request.first_scheduled is None:
                request.first_scheduled = now
        seqs, tokens, infos = self.runner.run(batch)
        for seq, token, info in zip(seqs, tokens, infos):
            self._append(self._requests[seq.seq_id], token, info)

    def _append(self, request: _Request, token: int, info: TokenLogprobs | None) -> None:
        seq = request.seq
        params = seq.params
        if request.first_token is None:
            request.first_token = time.monotonic()
            self.blocks.publish(seq)
        seq.token_ids.append(token)
        if info is not None:
            request.logprobs.append(info)
        reason = None
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids or token in params.stop_token_ids:
            reason = "stop"
            text = ""
        else:
            text = request.detok.add(token)
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_kv_cache_capacity
        ):
            reason = "length"
        text, stop_hit = self._apply_stop_strings(request, text, final=reason is not None)
        if stop_hit:
            reason = "stop"
        delta = StreamDelta(
            text,
            [token],
            reason,
            [info] if info is not None else None,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
        )
        if reason is None:
            request.channel.put(delta)
        else:
            self._finish(request, reason, delta)

    def _apply_stop_strings(self, request: _Request, text: str, final: bool) -> tuple[str, bool]:
        stops = request.seq.params.stop
        if final:
            text += request.detok.flush()
        if not stops:
            return text, False
        buf = request.pending + text
        hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if hits:
            request.pending = ""
            return buf[: min(hits)], True
        if final:
            request.pending = ""
            return buf, False
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        request.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _finish(self, request: _Request, reason: str, delta: StreamDelta | None = None) -> None:
        seq = request.seq
        self.blocks.publish(seq)
        self.scheduler.finish(seq, reason)
        self._requests.pop(seq.seq_id, None)
        if delta is None:
            delta = StreamDelta(
                request.pending, [], reason, None, seq.num_prompt_tokens, seq.num_output_tokens
            )
        if reason != "cancelled":
            self.stats.completed += 1
        request.channel.put(delta)
        self._report_metrics(request, reason)

    def _fail(self, request: _Request, error: BaseException) -> None:
        seq = request.seq
        self.scheduler.finish(seq, "error")
        self._requests.pop(seq.seq_id, None)
        self.stats.failed += 1
        request.channel.put(error)
        self._report_metrics(request, "error")

    def _report_metrics(self, request: _Request, reason: str) -> None:
        if request.on_metrics is None:
            return
        seq = request.seq
        end = time.monotonic()
        first = request.first_token
        generated = seq.num_output_tokens
        decoded = max(generated - 1, 0)
        generation_time = end - first if first is not None else 0.0
        metrics = GenerationMetrics(
            prompt_tokens=seq.num_prompt_tokens,
            generated_tokens=generated,
            decoded_tokens=decoded,
            time_to_first_token=(first - request.submitted) if first else 0.0,
            prefill_time=(first - request.first_scheduled) if first and request.first_scheduled else 0.0,
            generation_time=generation_time,
            decode_tokens_per_second=decoded / generation_time if decoded and generation_time > 0 else 0.0,
            reused_tokens=seq.num_cached_tokens,
            finish_reason=reason,
        )
        try:
            request.on_metrics(metrics)
        except Exception:
            log.exception("on_metrics callback raised")
