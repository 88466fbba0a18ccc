"""The engine of an RNN-T transcriber (Nemotron-3.5-ASR): one thread owns the model and runs the
submitted clips one after another, each whole: encode, then greedy transducer decoding, the tokens
streamed as they are found.

It answers the ``Engine`` calls ``LLM`` makes (submit, the plain-data views, shutdown), so that an
``LLM`` of a transcriber serves ``/v1/audio/transcriptions`` through the same seats, metrics and
streams as any model. There is no KV cache, no scheduler and no sampling: a request is one
``TransducerPrompt`` (``LLM.audio.prompt(samples, language)``), decoded greedily; ``max_tokens``
bounds the transcript.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from trtedge.runtime.engine import EngineConfig, EngineError, EngineStats, EngineUnavailableError
from trtedge.runtime.multimodal.transducer_audio import TransducerPrompt
from trtedge.runtime.output import (
    CancellableIterator,
    GenerationMetrics,
    LoopChannel,
    RequestHandle,
    StreamDelta,
)
from trtedge.runtime.profiling import Profiler
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("trtedge")


@dataclass(eq=False)
class _Clip:
    prompt: TransducerPrompt
    params: SamplingParams
    channel: queue.Queue | LoopChannel
    on_metrics: object
    submitted: float = field(default_factory=time.monotonic)
    cancelled: bool = False


class TransducerEngine:
    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        self.config = config
        self.model, self.tokenizer = model, tokenizer
        self.stats = EngineStats()
        self.profiler = Profiler(model.device)
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[_Clip | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_waiting = 0
        self._running: _Clip | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="trtedge-transducer", daemon=True)
        self._thread.start()
        log.info("engine: %s transcriber (RNN-T), one clip at a time", model.cfg.model_type)

    # ---- called from any thread -------------------------------------------------------------
    def submit(
        self,
        prompt,
        params: SamplingParams,
        priority: int = 0,
        on_metrics=None,
        request_id: str | None = None,
        channel: LoopChannel | None = None,
    ) -> CancellableIterator | RequestHandle:
        if not isinstance(prompt, TransducerPrompt):
            raise ValueError(
                f"this model ({self.model.cfg.model_type}) is an RNN-T transcriber: it takes one audio clip "
                "(POST /v1/audio/transcriptions, or LLM.audio.prompt(samples)), not text or chat messages"
            )
        for name, refused in (
            ("n", params.n != 1),
            ("guided_decoding", params.guided_decoding is not None),
            ("logprobs", params.logprobs is not None),
            ("prompt_logprobs", params.prompt_logprobs is not None),
        ):
            if refused:
                raise ValueError(f"{name} is not supported by a transducer (greedy transcription only)")
        clip = _Clip(prompt, params, channel or queue.Queue(), on_metrics)
        with self._lock:
            if self.error is not None:
                raise EngineUnavailableError(f"engine failed: {self.error}")
            if self._stopped:
                raise EngineUnavailableError("the engine is shut down")
            self.stats.submitted += 1
            self._num_waiting += 1
            self._queue.put(clip)
        if channel is not None:
            return RequestHandle(lambda: self._cancel(clip))
        return CancellableIterator(clip.channel, lambda: self._cancel(clip))

    def _cancel(self, clip: _Clip) -> None:
        clip.cancelled = True

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    @property
    def num_active(self) -> int:
        return self._num_waiting + (self._running is not None)

    # ---- plain-data views ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        stats = self.stats
        return {
            "active_requests": self.num_active,
            "running": int(self._running is not None),
            "waiting": self._num_waiting,
            "kv_blocks_total": 0,
            "kv_blocks_free": 0,
            "kv_block_size": 0,
            "kv_cache_bytes": 0,
            "submitted": stats.submitted,
            "completed": stats.completed,
            "cancelled": stats.cancelled,
            "failed": stats.failed,
            "joined_mid_flight": 0,
            "preemptions": 0,
            "steps": stats.steps,
            "restarts": 0,
            "engine_error": None if self.error is None else str(self.error),
            "speculative": None,
        }

    def describe(self) -> dict:
        model = self.model
        return {
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "weight_bytes": int(model.weight_bytes),
            "kv_bytes_per_token": 0,
            "vocab_size": model.cfg.vocab_size,
            "model_type": model.cfg.model_type,
            "async_scheduling": False,
        }

    def context_cache_metrics(self) -> dict:
        return {"lookups": 0, "hits": 0, "reused_tokens": 0, "records": 0, "evictions": 0}

    def mm_embedding_cache_metrics(self) -> dict | None:
        return None

    def speculative_metrics(self) -> dict | None:
        return None

    def compile_guide(self, guide) -> None:
        raise ValueError("structured output is not supported by a transducer (greedy transcription only)")

    def set_profiling_enabled(self, enabled: bool) -> None:
        self.profiler.enabled = enabled

    def get_profiling_enabled(self) -> bool:
        return self.profiler.enabled

    def get_profiling_metrics(self):
        return self.profiler.metrics()

    def reset_profiling_metrics(self) -> None:
        self.profiler.reset()

    # ---- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            clip = self._queue.get()
            if clip is None:
                break
            with self._lock:
                self._num_waiting -= 1
                self._running = clip
            try:
                self._transcribe(clip)
            except Exception as e:  # this clip fails; the engine keeps serving the next ones
                log.exception("transcription failed")
                self.stats.failed += 1
                self._running = None
                self._put(clip, EngineError(f"the transcription failed: {e}"))
        while True:  # shut down: whatever is still queued is refused
            try:
                clip = self._queue.get_nowait()
            except queue.Empty:
                break
            if clip is not None:
                self._put(clip, EngineUnavailableError("engine shut down"))

    def _transcribe(self, clip: _Clip) -> None:
        prompt, params = clip.prompt, clip.params
        num_prompt = len(prompt.ids)
        metrics = GenerationMetrics(prompt_tokens=num_prompt, forward_passes=1)
        if clip.cancelled:
            return self._finish(clip, "cancelled", metrics, "")
        start = time.monotonic()
        [item] = prompt.items
        frames = self.model.encode(item.pixels, prompt.prompt_id, prompt.lookahead)
        metrics.prefill_time = time.monotonic() - start
        self.stats.steps += 1
        detok = IncrementalDetokenizer(self.tokenizer, None, params.skip_special_tokens)
        count, reason = 0, "stop"
        for token in self.model.greedy(frames):
            if clip.cancelled:
                reason = "cancelled"
                break
            if count >= params.max_tokens:
                reason = "length"
                break
            count += 1
            if count == 1:
                metrics.time_to_first_token = time.monotonic() - clip.submitted
            text = detok.add(token)
            self._put(
                clip, StreamDelta(text, [token], None, prompt_tokens=num_prompt, completion_tokens=count)
            )
        metrics.generated_tokens = count
        metrics.decoded_tokens = max(count - 1, 0)
        metrics.generation_time = time.monotonic() - start - metrics.prefill_time
        if metrics.generation_time > 0 and count > 1:
            metrics.decode_tokens_per_second = (count - 1) / metrics.generation_time
        self._finish(clip, reason, metrics, detok.flush())

    def _finish(self, clip: _Clip, reason: str, metrics: GenerationMetrics, text: str) -> None:
        metrics.finish_reason = reason
        if reason == "cancelled":
            self.stats.cancelled += 1
        else:
            self.stats.completed += 1
        count = metrics.generated_tokens
        self._running = None  # before the last delta: whoever reads it sees the engine idle
        self._put(
            clip, StreamDelta(text, [], reason, prompt_tokens=len(clip.prompt.ids), completion_tokens=count)
        )
        if clip.on_metrics is not None:
            try:
                clip.on_metrics(metrics)
            except Exception:
                log.exception("on_metrics callback failed")

    @staticmethod
    def _put(clip: _Clip, item) -> None:
        clip.channel.put(item)
        if isinstance(clip.channel, LoopChannel):  # hand it to the event loop now, not after a step
            clip.channel.batcher.flush()
