"""The engine: one thread owns the model and the KV cache and runs
schedule -> execute -> update (emit deltas). Other threads submit and cancel through
thread-safe queues and read per-request output channels.

With asynchronous scheduling (CUDA) the update of a step runs while the device computes the next one:
the next step's inputs take the sampled ids on the device, and the host reads each step's tokens one
step late."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.hybrid_state import HybridStateCache
from trtedge.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput
from trtedge.runtime.core.partial_blocks import PartialBlockCache
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from trtedge.runtime.core.speech import SpeechDelta, SpeechScheduler, SpeechSequence
from trtedge.runtime.executor.runner import ModelRunner, PromptScores, kv_block_bytes
from trtedge.runtime.executor.sampler import Sampler, SampleResult, TokenLogprobs, is_plain, mix_seed
from trtedge.runtime.executor.state_pool import row_bytes
from trtedge.runtime.faults import FaultInjector
from trtedge.runtime.models.protocol import HybridCausalLM
from trtedge.runtime.multimodal import MultimodalPrompt
from trtedge.runtime.multimodal.inputs import encode_batch_media
from trtedge.runtime.output import (
    CancellableIterator,
    GenerationMetrics,
    LoopBatcher,
    LoopChannel,
    RequestHandle,
    StreamDelta,
    TextStream,
)
from trtedge.runtime.profiling import MULTIMODAL, SCHEDULE, SPECULATIVE, GcPauses, Profiler
from trtedge.runtime.sampling_params import ParamError, SamplingParams, check_logit_bias
from trtedge.runtime.speculative import SpeculativeConfig, build_decoder
from trtedge.runtime.speculative.decoder import SpecStats, may_speculate
from trtedge.runtime.structured import GuidedDecoding
from trtedge.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("trtedge")

MAX_CONSECUTIVE_FAILURES = 3
SPEC_GRAPH_ROWS = 256  # most decode rows a speculative engine's CUDA graphs capture (verify: k + 1 a request)
HYBRID_MAX_JUMP_TOKENS = 4  # jump-forward draft cap on hybrid models (see _hybrid_state)


class EngineError(RuntimeError):
    """A model step failed while this request was in it. The engine restarted and serves new requests."""


class EngineUnavailableError(RuntimeError):
    """The engine has stopped (it failed and could not restart, or it was shut down)."""


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
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs on a GPU
    speculative: SpeculativeConfig | None = None
    # Hybrid models: bytes of recurrent-state snapshots kept for context reuse (None: 4 x max_batch_size)
    recurrent_snapshot_pool_bytes: int | None = None
    mm_embedding_cache_bytes: int = 512 * 2**20  # vision models: encoder outputs kept for repeated media
    # Context reuse: bytes of snapshots of the last, partly filled block of published prefixes (0: off)
    partial_kv_snapshot_pool_bytes: int = 0
    # Overlap the host's update of a step with the device's next step. None: on for CUDA, where the model
    # has no media encoder, no tensor parallelism and no speculative decoding.
    async_scheduling: bool | None = None
    # Make each delta's text here (detokenization, stop strings). False: the consumer does it (the
    # engine core process's client, see client.py) and stops a choice at a stop string (``stop_choice``).
    detokenize: bool = True
    kv_cache_dtype: str = "auto"  # "fp8": E4M3 KV with a scale per head of each token (CUDA, ops.kv_fp8)


@dataclass
class EngineStats:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    joined_mid_flight: int = 0
    preemptions: int = 0
    steps: int = 0
    restarts: int = 0


@dataclass(eq=False)
class _Request:
    """One submitted request: an output channel shared by its ``n`` choices, and its metrics."""

    channel: queue.Queue | LoopChannel
    on_metrics: Callable[[GenerationMetrics], None] | None
    batcher: LoopBatcher | None  # a LoopChannel's: flushed after each step
    choices: list[_Choice] = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    num_open: int = 0
    num_jump_forward_tokens: int = 0  # draft tokens the model agreed with (no pass of their own)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled by the prefill when asked for
    finish_reason: str | None = None  # choice 0's, or "cancelled" / "error" for the whole request


@dataclass
class _Choice:
    """One generated sequence of a request (``index`` in 0..n-1); choice 0 prefills the prompt and the
    others fork from it after its first token."""

    seq: Sequence
    request: _Request
    index: int
    text: TextStream | None  # None: the consumer makes the text (EngineConfig.detokenize false)
    first_token: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _split_decode(batch: ScheduledBatch) -> list[ScheduledBatch]:
    """Run one-token rows apart from prefill chunks: a pure decode batch takes the fast path (native CPU
    kernels, CUDA graphs), which a single prefill row joining the batch would otherwise deny to all."""
    if all(n == 1 for n in batch.num_tokens) or all(n > 1 for n in batch.num_tokens):
        return [batch]
    decode = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if n == 1]
    prefill = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if n > 1]
    return [ScheduledBatch([s for s, _ in rows], [n for _, n in rows]) for rows in (decode, prefill)]


class SpeechStream(CancellableIterator):
    """The ``SpeechDelta``s of one speech sequence (the last has the finish reason). A live one speaks
    an answer still being generated: ``push_text`` its next token ids, ``end_text`` at its end."""

    def __init__(
        self, channel: queue.Queue, cancel: Callable[[], None], feed: Callable[[list[int], bool], None]
    ):
        super().__init__(channel, cancel)
        self._feed = feed

    def push_text(self, token_ids: list[int]) -> None:
        self._feed(list(token_ids), False)

    def end_text(self) -> None:
        self._feed([], True)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig, draft=None, speech=None):
        """``draft``: the loaded draft model or EAGLE-3 head when ``config.speculative`` needs one;
        ``speech``: the loaded ``SpeechPipeline`` (Talker, code predictor, Code2Wav) of a model that
        speaks, run as speech sequences beside the thinker's (``submit_speech``)."""
        self.config = config
        self.tokenizer = tokenizer
        bs = config.block_size
        num_blocks = config.num_blocks or config.max_batch_size * -(-config.max_kv_cache_capacity // bs)
        if num_blocks * bs < config.max_kv_cache_capacity:
            raise ValueError(
                f"a KV pool of {num_blocks} blocks x {bs} tokens cannot hold one request of "
                f"max_kv_cache_capacity {config.max_kv_cache_capacity} tokens"
            )
        self.num_blocks = num_blocks
        self._model, self._tokenizer = model, tokenizer
        self.num_partial_snapshots = _num_partial_snapshots(model, config)
        self.blocks = self._new_block_manager()
        sched = SchedulerConfig(
            max_batch_size=config.max_batch_size,
            max_num_batched_tokens=max(config.max_num_batched_tokens, bs),
            enable_in_flight_batching=config.enable_in_flight_batching,
            whole_drafts=self.blocks.state is not None,
            max_seq_len=config.max_kv_cache_capacity,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
        )
        self.scheduler = Scheduler(sched, self.blocks)
        self.guides = GuidedDecoding(tokenizer, model.cfg.vocab_size)
        if self.blocks.state is not None:  # hybrid: a draft keeps a recurrent state per token (scratch rows)
            self.guides.max_jump_tokens = self.blocks.state.window - 1
        spec = config.speculative
        graph_rows = None
        if spec is not None:  # a chain's verify step scores one decode row per node
            per_seq = 1 + min(spec.num_speculative_tokens, spec.verify_tokens)
            graph_rows = max(config.max_batch_size, min(config.max_batch_size * per_seq, SPEC_GRAPH_ROWS))
            if (
                config.cuda_graphs
                and model.device.type == "cuda"
                and config.max_batch_size * per_seq > graph_rows
            ):
                log.info(
                    "speculative decoding: CUDA graphs are captured up to %d rows; a step whose verify (or "
                    "draft) rows exceed that (up to %d sequences x %d rows each) runs eagerly",
                    graph_rows,
                    config.max_batch_size,
                    per_seq,
                )
        self.runner = ModelRunner(
            model,
            num_blocks,
            bs,
            Sampler(tokenizer.eos_token_ids),
            max_batch_size=config.max_batch_size,
            max_blocks_per_seq=-(-config.max_kv_cache_capacity // bs),
            cuda_graphs=config.cuda_graphs,
            guides=self.guides,
            state=self.blocks.state,
            mm_embedding_cache_bytes=config.mm_embedding_cache_bytes,
            num_partial_snapshots=self.num_partial_snapshots,
            graph_rows=graph_rows,
            kv_cache_dtype=config.kv_cache_dtype,
            verify_chains=spec is not None,
        )
        self.profiler = Profiler(model.device)
        self.speculative = None
        if config.speculative is not None:
            self.speculative = build_decoder(
                config.speculative,
                draft,
                self.runner,
                self.blocks,
                sched.max_num_batched_tokens,
                config.max_kv_cache_capacity,
            )
        plain = self.speculative is None and self.runner.media is None and self.runner.tp is None
        wanted = config.async_scheduling
        self.async_scheduling = plain and (self.runner.on_cuda if wanted is None else wanted)
        self._inflight: list[tuple[list[Sequence], SampleResult]] = []  # launched, not yet read back
        self.speech = None
        if speech is not None:
            from trtedge.runtime.speech.runner import SpeechRunner

            self.speech = SpeechRunner(speech)
        self.speech_scheduler = SpeechScheduler(
            config.max_batch_size if config.enable_in_flight_batching else 1
        )
        self._speaking: dict[int, tuple[SpeechSequence, queue.Queue]] = {}  # guarded by the engine thread
        log.info(
            "engine: %s, max_batch_size %d, %d tokens per step, context reuse %s",
            "in-flight batching" if config.enable_in_flight_batching else "one request at a time",
            config.max_batch_size if config.enable_in_flight_batching else 1,
            sched.max_num_batched_tokens,
            f"on (max {config.context_cache_max_records} records)" if config.enable_context_reuse else "off",
        )
        self.stats = EngineStats()
        self.gc_pauses: GcPauses | None = None  # the engine-core process's collector time
        self.error: BaseException | None = None  # set when the engine gave up: new requests are refused
        self._faults = FaultInjector.from_env()
        self._submit_lock = threading.RLock()  # a submit never slips past the engine's final drain
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: set[_Request] = set()  # guarded by the engine thread
        self._request_ids: set[str] = set()  # of the requests in flight (their choices'); _submit_lock
        self._choices: dict[int, _Choice] = {}  # seq_id -> choice, for sequences in the scheduler
        self._batchers: set[LoopBatcher] = set()  # event loops with deltas of this step to hand over
        self._wake = threading.Event()
        self._stopped = False
        self._rng = random.Random(0)  # unseeded requests repeat across runs when served alone
        self._rng_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="trtedge-engine", daemon=True)
        self._thread.start()

    # ---- called from any thread -------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int] | MultimodalPrompt,
        params: SamplingParams,
        priority: int = 0,
        on_metrics: Callable[[GenerationMetrics], None] | None = None,
        request_id: str | None = None,
        channel: LoopChannel | None = None,
    ) -> CancellableIterator | RequestHandle:
        """Queue a request; its ``params.n`` choices stream into one iterator (``StreamDelta.index``), or,
        given a ``channel``, to its event loop, batched per step (then the returned handle only cancels)."""
        mm = prompt_ids if isinstance(prompt_ids, MultimodalPrompt) else None
        if mm is not None:
            if self.runner.media is None:
                raise ValueError("this model has no vision component: images and videos are not supported")
            if self.speculative is not None or self.runner.tp is not None:
                raise ValueError(
                    "image and video input is not supported with speculative decoding or tensor parallelism yet"
                )
            prompt_ids = mm.ids
        check_logit_bias(params, self.runner.model.cfg.vocab_size)
        params = self._resolve_cache_generated(params)
        grammar = self.guides.compile(params.guided_decoding) if params.guided_decoding else None
        seed = params.seed
        if seed is None:
            with self._rng_lock:
                seed = self._rng.getrandbits(64)
        request = _Request(channel or queue.Queue(), on_metrics, channel.batcher if channel else None)
        for index in range(params.n):
            rid = request_id if index == 0 or request_id is None else f"{request_id}-{index}"
            seq = Sequence(prompt_ids, params, priority, rid)
            if index == 0 and params.prompt_logprobs is not None:  # the choices fork from its prefill
                seq.prompt_logprobs = params.prompt_logprobs
                request.prompt_logprobs = [None]
            seq.mm = mm
            seq.seed = seed if index == 0 else mix_seed(seed, -1 - index)
            if grammar is not None:
                seq.matcher = self.guides.matcher(grammar)
            if self.blocks.state is not None and self.blocks.enable_reuse:
                seq.checkpoint_limit = self.blocks.state.checkpoint_limit(
                    prompt_ids, params.reuse_context, params.cache_generated_tokens
                )
            text = None
            if self.config.detokenize:
                text = TextStream(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop)
            request.choices.append(_Choice(seq, request, index, text))
        request.num_open = params.n
        ids = {choice.seq.request_id for choice in request.choices}
        with self._submit_lock:
            if self.error is not None:
                raise EngineUnavailableError(f"engine failed: {self.error}")
            if self._stopped:
                raise EngineUnavailableError("the engine is shut down")
            taken = sorted(ids & self._request_ids)
            if taken:  # the scheduler and its outputs are keyed by request id
                raise ValueError(f"request_id {taken[0]!r} is already in use by a request in flight")
            self._request_ids |= ids
            self._inbox.put(("add", request))
        self._wake.set()
        if channel is not None:
            return RequestHandle(lambda: self._cancel(request), lambda i, n: self._stop_choice(request, i, n))
        return CancellableIterator(request.channel, lambda: self._cancel(request), params.n)

    def submit_speech(
        self, prompt_ids: list[int], voice: str, sampling, chunk_frames: int, live: bool = False
    ) -> SpeechStream:
        """Queue a speech sequence: the Talker speaks the last assistant turn of ``prompt_ids`` in
        ``voice`` (``sampling``: a ``TalkerSampling``), Code2Wav a piece every ``chunk_frames`` frames.
        ``live``: the answer is still being generated (``SpeechStream.push_text`` / ``end_text``).
        Refuses (``SpeechInputError`` naming the field) before anything is queued."""
        if self.speech is None:
            raise ValueError("this model has no speech output (no Talker / Code2Wav components)")
        start = self.speech.pipeline.check(prompt_ids, voice)
        rows = len(prompt_ids) - start - 4
        seq = SpeechSequence(list(prompt_ids), voice, sampling, chunk_frames, rows + (not live), not live)
        channel: queue.Queue = queue.Queue()
        with self._submit_lock:
            if self.error is not None:
                raise EngineUnavailableError(f"engine failed: {self.error}")
            if self._stopped:
                raise EngineUnavailableError("the engine is shut down")
            self._inbox.put(("speech", (seq, channel)))
        self._wake.set()

        def feed(token_ids: list[int], done: bool) -> None:
            self._inbox.put(("speech_text", (seq, token_ids, done)))
            self._wake.set()

        def cancel() -> None:
            self._inbox.put(("speech_cancel", seq))
            self._wake.set()

        return SpeechStream(channel, cancel, feed)

    def _resolve_cache_generated(self, params: SamplingParams) -> SamplingParams:
        """``cache_generated_tokens`` unset: publish generated tokens, except where a hybrid model
        speculates (its verification keeps no checkpoints past the prompt: only the prompt's snapshot
        is published); set to true there, the request is refused."""
        hybrid_spec = (
            self.speculative is not None
            and self.blocks.state is not None
            and self.blocks.enable_reuse
            and params.reuse_context
            and may_speculate(params)
        )
        if params.cache_generated_tokens is None:
            return replace(params, cache_generated_tokens=not hybrid_spec)
        if params.cache_generated_tokens and hybrid_spec:
            raise ParamError(
                "cache_generated_tokens",
                "cache_generated_tokens must not be true with speculative decoding on a hybrid model "
                f"({self.runner.model.cfg.model_type}: only the prompt's recurrent state is cached); "
                "leave it unset, set it to false, or set disable_spec_decode",
            )
        return params

    def _cancel(self, request: _Request) -> None:
        self._inbox.put(("cancel", request))
        self._wake.set()

    def _stop_choice(self, request: _Request, index: int, num_output_tokens: int) -> None:
        self._inbox.put(("stop", (request, index, num_output_tokens)))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_active(self) -> int:
        return len(self._requests) + len(self._speaking)

    # ---- plain-data views (what a client, in this process or another, reads) ----------------------
    def snapshot(self) -> dict:
        """Counters and pool sizes now, for health endpoints and dashboards (any thread)."""
        stats, blocks = self.stats, self.blocks
        state = blocks.state
        extra = {}
        if state is not None:  # recurrent-state slots of hybrid models (one per batch seat)
            extra = {
                "state_slots_total": state.num_slots,
                "state_slots_free": state.num_free_slots,
                "recurrent_state_bytes": self.runner.states.nbytes,
            }
        snapshot = {
            "active_requests": self.num_active,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "kv_block_size": blocks.block_size,
            "kv_cache_bytes": self.runner.kv_bytes,
            "submitted": stats.submitted,
            "completed": stats.completed,
            "cancelled": stats.cancelled,
            "failed": stats.failed,
            "joined_mid_flight": stats.joined_mid_flight,
            "preemptions": stats.preemptions,
            "steps": stats.steps,
            "restarts": stats.restarts,
            "engine_error": None if self.error is None else str(self.error),
            "speculative": self.speculative_metrics(),
            **extra,
        }
        if self.gc_pauses is not None:
            snapshot["gc"] = self.gc_pauses.as_dict()
        ple = getattr(self.runner.model, "ple", None)  # Gemma 3n / Gemma 4 per-layer embeddings
        if ple is not None:
            snapshot["ple_cache"] = ple.stats()
        return snapshot

    def describe(self) -> dict:
        """What is loaded: device, dtype, weight bytes, KV bytes per token, vocabulary size."""
        model, kv = self.runner.model, self.runner.kv
        return {
            "device": str(model.device),
            "dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
            "weight_bytes": int(getattr(model, "weight_bytes", 0)),
            # kv: (layers, 2, blocks, block_size, kv_heads, head_dim)
            "kv_bytes_per_token": kv.shape[0] * 2 * kv.shape[-2] * kv.shape[-1] * kv.element_size(),
            "vocab_size": model.cfg.vocab_size,
            "model_type": model.cfg.model_type,
            "async_scheduling": self.async_scheduling,
        }

    def context_cache_metrics(self) -> dict:
        """Context reuse counters (the fields of ``ContextCacheMetrics`` that apply)."""
        blocks = self.blocks
        stats, state, partial = blocks.stats, blocks.state, blocks.partial
        out = {
            "lookups": stats.lookups,
            "hits": stats.hits,
            "reused_tokens": stats.reused_tokens,
            "records": blocks.num_records,
            "evictions": stats.evictions,
        }
        if state is not None:
            out.update(
                recurrent_snapshots=state.num_entries,
                recurrent_snapshot_capacity=state.num_snapshots,
                recurrent_snapshot_evictions=state.stats.evictions,
                recurrent_snapshot_pool_bytes=state.num_snapshots * self.runner.states.row_bytes,
            )
        if partial is not None:
            out.update(
                partial_kv_snapshots=partial.num_held,
                partial_kv_snapshot_capacity=partial.num_entries,
                partial_kv_snapshot_evictions=partial.stats.evictions,
                partial_kv_snapshot_pool_bytes=partial.num_entries
                * self.runner.partial_kv_bytes_per_snapshot,
                partial_kv_reused_tokens=stats.partial_reused_tokens,
            )
        return out

    def mm_embedding_cache_metrics(self) -> dict | None:
        media = self.runner.media
        return None if media is None else media.metrics()

    def speculative_metrics(self) -> dict | None:
        spec = self.speculative
        if spec is None:
            return None
        totals = spec.stats
        return {
            **spec.config.to_dict(),
            "steps": totals.steps,
            "draft_tokens": totals.draft_tokens,
            "accepted_tokens": totals.accepted_tokens,
            "acceptance_rate": round(totals.acceptance_rate, 4),
            "mean_accepted_length": round(totals.mean_accepted_length, 4),
            "proposal_time": round(totals.proposal_time, 4),
            "verification_time": round(totals.verification_time, 4),
        }

    def compile_guide(self, guide) -> None:
        self.guides.compile(guide)

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
        failures = 0
        while not self._stopped:
            self._drain_inbox()
            self._flush()
            speaks = self.speech_scheduler.has_work
            if not self.scheduler.has_work and not speaks:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            if speaks:  # a frame for each speech sequence that can make one, between the thinker's steps
                self._speak()
                if not self.scheduler.has_work:
                    continue
            try:
                if not self.step():  # nothing could run (cannot happen with a valid pool): do not spin
                    self._wake.wait(timeout=0.01)
                    self._wake.clear()
                failures = 0
            except Exception as e:  # fail the requests in the step, restart, keep serving the others
                log.exception("engine step failed")
                failures += 1
                if failures >= MAX_CONSECUTIVE_FAILURES:  # the device or the model is broken: stop
                    log.error("engine failed %d steps in a row; refusing new requests", failures)
                    self.error = e
                    break
                try:
                    self._restart(e)
                except Exception as restart_error:
                    log.exception("engine restart failed; refusing new requests")
                    self.error = restart_error
                    break
            finally:
                self._flush()
        with self._submit_lock:
            self._stopped = True
            self._drain_inbox()
        reason = f"engine failed: {self.error}" if self.error is not None else "engine shut down"
        for request in list(self._requests):
            self._fail(request, EngineUnavailableError(reason))
        for seq, _ in list(self._speaking.values()):
            self._end_speech(seq, "error", EngineUnavailableError(reason))
        self._flush()
        stats = self.stats
        log.info(
            "engine stopped: %d requests in %d steps, %d joined a running batch, %d preemptions, %d restarts",
            stats.submitted,
            stats.steps,
            stats.joined_mid_flight,
            stats.preemptions,
            stats.restarts,
        )

    def _restart(self, cause: Exception) -> None:
        """Fail the requests whose sequences were running (their KV state is suspect), then start over
        with a fresh KV pool and scheduler that keep the waiting requests, after a probe step."""
        error = EngineError(
            f"the engine failed while generating this request ({type(cause).__name__}: {cause})"
        )
        running = {
            self._choices[s.seq_id].request for s in self.scheduler.running if s.seq_id in self._choices
        }
        for request in running:
            self._fail(request, error)
        waiting = self.scheduler.waiting
        self._inflight = []
        self.runner.end_step()
        for seq in waiting:
            seq.block_table, seq.num_computed_tokens, seq.num_cached_tokens = [], 0, 0
            seq.num_inflight = 0  # a sample lost with the step: drawn again (same seed, same token)
            if self.speculative is not None:
                self.speculative.release(seq)  # its draft state starts over too
        self._faults.before_restart()
        blocks = self._new_block_manager()
        scheduler = Scheduler(self.scheduler.config, blocks)
        probe = Sequence([0], SamplingParams(max_tokens=1, temperature=0))
        blocks.grow(probe, 1)
        self.runner.run(ScheduledBatch([probe], [1]))  # the device still computes
        blocks.release(probe)
        scheduler.adopt(waiting)
        self.blocks, self.scheduler = blocks, scheduler
        self.stats.restarts += 1
        log.warning(
            "engine restarted (%d so far): %d request(s) failed, %d waiting kept",
            self.stats.restarts,
            len(running),
            len(waiting),
        )

    def _new_block_manager(self) -> BlockManager:
        config = self.config
        return BlockManager(
            self.num_blocks,
            config.block_size,
            enable_reuse=config.enable_context_reuse,
            max_records=config.context_cache_max_records,
            state=_hybrid_state(self._model, self._tokenizer, config),
            partial=PartialBlockCache(self.num_partial_snapshots) if self.num_partial_snapshots else None,
        )

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._requests.add(request)
                leader = request.choices[0]
                self._choices[leader.seq.seq_id] = leader
                self.scheduler.add(leader.seq)
                self.stats.submitted += 1
            elif kind == "cancel" and request in self._requests:
                request.finish_reason = "cancelled"
                for choice in request.choices:
                    if not choice.seq.is_finished:
                        self._finish(choice, "cancelled")
            elif kind == "stop":
                request, index, count = request
                choice = request.choices[index]
                if request in self._requests and not choice.seq.is_finished:
                    self._stop_at(choice, count)
            elif kind == "speech":
                seq, channel = request
                self._speaking[seq.seq_id] = (seq, channel)
                self.speech_scheduler.add(seq)
            elif kind == "speech_text":
                seq, token_ids, done = request
                seq.push_text(token_ids)
                if done:
                    seq.end_text()
            elif kind == "speech_cancel" and request.seq_id in self._speaking:
                self._end_speech(request, "cancelled")

    def _speak(self) -> None:
        """One frame of every speech sequence that can make one; the audio pieces they complete."""
        for seq in self.speech_scheduler.schedule():
            try:
                ended, piece = self.speech.step(seq)
            except Exception as e:  # this speech fails; the thinker and the other speeches go on
                log.exception("speech step failed")
                self._end_speech(seq, "error", EngineError(f"the Talker failed ({type(e).__name__}: {e})"))
                continue
            if ended:
                self._end_speech(seq, "stop", piece)
            elif piece is not None:
                self._speaking[seq.seq_id][1].put(SpeechDelta(piece, seq.num_frames, None))

    def _end_speech(self, seq: SpeechSequence, reason: str, last=None) -> None:
        """Finish a speech sequence: its caches freed, its last delta (``last``: an error, or the final
        piece of audio) sent."""
        self.speech_scheduler.finish(seq, reason)
        if self.speech is not None:
            self.speech.release(seq)
        _, channel = self._speaking.pop(seq.seq_id)
        if isinstance(last, BaseException):
            channel.put(last)
        else:
            channel.put(SpeechDelta(last, seq.num_frames, reason))

    def _stop_at(self, choice: _Choice, num_output_tokens: int) -> None:
        """The consumer found a stop string ending at output token ``num_output_tokens``: finish there,
        dropping the tokens made past it (their blocks are not offered for reuse)."""
        seq = choice.seq
        extra = seq.num_output_tokens - num_output_tokens
        if extra > 0:
            del seq.token_ids[len(seq.token_ids) - extra :]
            del choice.logprobs[num_output_tokens:]
            seq.num_draft_tokens = 0
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
        self._finish(choice, "stop", publish=extra <= 0)

    def step(self) -> bool:
        """One engine step: schedule -> execute -> update. False if nothing ran. Asynchronously, the
        update is the previous step's, done while the device runs this one."""
        overlap = self.async_scheduling and self._can_overlap()
        if not overlap:
            self._update()
        with self.profiler.stage(SCHEDULE, on_device=False):
            batch = self.scheduler.schedule()
        self.stats.steps += 1
        self.stats.preemptions += len(batch.preempted)
        if batch.joined:
            self.stats.joined_mid_flight += batch.joined
            log.debug("step %d: %d request(s) joined the running batch", self.stats.steps, batch.joined)
        if batch.is_empty:
            return self._update()
        now = time.monotonic()
        for seq in batch.seqs:
            seq.num_forward_passes += 1
            request = self._choices[seq.seq_id].request
            if request.first_scheduled is None:
                request.first_scheduled = now
        self.runner.restore_partial_blocks(batch.seqs)
        if overlap:
            self.runner.prepare_states(batch.seqs)  # hybrid: stream-ordered after the step in flight
            launched = self._launch(batch)
            self._update()
            self._inflight = launched
            return True
        if self.speculative is not None:
            with self.profiler.stage(SPECULATIVE):
                batch = self._speculate(batch)
        self.runner.prepare_states(batch.seqs)
        for part in _split_decode(batch):
            if part.is_empty:
                continue
            if self.runner.media is not None:
                with self.profiler.stage(MULTIMODAL):
                    part = self._encode_media(part)
                if part.is_empty:
                    continue
            self._faults.before_model_step(part.seqs)
            with self.profiler.stage(self.profiler.model_step(part.seqs, part.num_tokens)):
                seqs, tokens, infos, scores = self.runner.run(part)
            for scored in scores:
                self._record_prompt_logprobs(scored)
            if self.speculative is not None:
                self.speculative.observe(part)
            self._process(ModelRunnerOutput.from_rows([s.request_id for s in seqs], tokens, infos))
            for seq in dict.fromkeys(seqs):  # a draft's rows are one sequence's
                guide = seq.params.guided_decoding
                if guide is not None and guide.jump_forward and not seq.is_finished:
                    self.guides.propose(seq)
        return True

    def _can_overlap(self) -> bool:
        """Every request the next step may take samples without its previous token on the host: no
        guide (its mask follows the last token), no penalties (they read the tokens so far), no draft,
        no prompt logprobs."""
        sched = self.scheduler
        return all(_samples_on_device(s) for s in sched.running) and all(
            _samples_on_device(s) for s in sched.waiting
        )

    def _launch(self, batch: ScheduledBatch) -> list[tuple[list[Sequence], SampleResult]]:
        """Enqueue the step's parts on the device; their samples stay there until ``_update``."""
        launched = []
        for part in _split_decode(batch):
            if part.is_empty:
                continue
            self._faults.before_model_step(part.seqs)
            with self.profiler.stage(self.profiler.model_step(part.seqs, part.num_tokens)):
                seqs, result, _ = self.runner.execute(part, keep=True)
            if result is not None:
                for seq in seqs:
                    seq.num_inflight += 1
                launched.append((seqs, result))
        self.runner.end_step()
        return launched

    def _update(self) -> bool:
        """Read back the launched step's samples and append them (stops, finishes, deltas). False if
        nothing was in flight."""
        launched, self._inflight = self._inflight, []
        for seqs, result in launched:
            tokens, infos = result.host()
            for seq in seqs:
                seq.num_inflight -= 1
            # a request finished (or cancelled) while its step ran is skipped by the scheduler
            self._process(ModelRunnerOutput.from_rows([s.request_id for s in seqs], tokens, infos))
        return bool(launched)

    def _record_prompt_logprobs(self, scored: PromptScores) -> None:
        """Keep the prompt logprobs a step computed; positions already kept (a preempted prefill that runs
        again) are skipped, and once all are in the sequence stops asking."""
        seq = scored.seq
        choice = self._choices.get(seq.seq_id)
        if choice is None or choice.request.prompt_logprobs is None:
            return
        kept = choice.request.prompt_logprobs
        if scored.first > len(kept):  # cannot happen: a scored prompt is computed from its start
            raise RuntimeError(f"internal error: request {seq.request_id} skipped prompt logprobs")
        kept.extend(scored.logprobs[len(kept) - scored.first :])
        if len(kept) >= seq.num_prompt_tokens:
            seq.prompt_logprobs = None

    def _encode_media(self, part: ScheduledBatch) -> ScheduledBatch:
        """Encode the images / videos the step reaches; a request whose own media fail to encode fails
        alone (its blocks freed), and the step runs without it."""
        failed = encode_batch_media(self.runner.media, part)
        if not failed:
            return part
        for seq, error in failed:
            choice = self._choices.get(seq.seq_id)
            if choice is not None and choice.request in self._requests:
                log.error("request %s: its media could not be encoded: %r", seq.request_id, error)
                self._fail(
                    choice.request,
                    EngineError(
                        f"the request's image or video could not be encoded ({type(error).__name__}: {error})"
                    ),
                )
        rows = [(s, n) for s, n in zip(part.seqs, part.num_tokens) if not s.is_finished]
        return ScheduledBatch([s for s, _ in rows], [n for _, n in rows])

    def _speculate(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Draft, verify and emit the batch's speculative decode rows; return the rows left to run."""
        results, rest = self.speculative.step(batch)
        if results:
            self.profiler.count(generation_runs=1)
            self._process(ModelRunnerOutput({seq.request_id: tuple(tokens) for seq, tokens in results}))
        return rest

    def _process(self, output: ModelRunnerOutput) -> None:
        """A step's samples: the scheduler's bookkeeping, then each request's deltas."""
        for update in self.scheduler.update_from_output(output):
            seq = self.scheduler.get(update.request_id)
            choice = self._choices.get(seq.seq_id) if seq is not None else None
            if choice is not None:
                self._deliver(choice, update)

    def _deliver(self, choice: _Choice, update: EngineCoreOutput) -> None:
        """One request's kept tokens as deltas, one a token (text, stop strings, logprobs); finish it
        where the scheduler or a stop string says so, dropping any token kept past a stop string."""
        seq, request = choice.seq, choice.request
        if update.rolled_back:  # rejected draft positions: any unpaged state goes back with them
            seq.num_computed_tokens = self.runner.rollback(seq, seq.num_computed_tokens)
        request.num_jump_forward_tokens += update.num_accepted_draft
        ids = update.new_token_ids
        final_reason = None if update.rejected is not None else update.finish_reason
        for j, token in enumerate(ids):
            after = len(ids) - 1 - j  # tokens kept after this one
            info = update.logprobs[j] if update.logprobs else None
            first = choice.first_token is None
            if first:
                choice.first_token = time.monotonic()
                if request.first_token is None:
                    request.first_token = choice.first_token
                self._publish(seq)
                if choice.index == 0:
                    self._fork(request)
            self.profiler.count(generated_tokens=1)
            if info is not None:
                choice.logprobs.append(info)
            reason = final_reason if after == 0 else None
            stop_token = update.stop_token and after == 0
            text = ""
            if choice.text is not None:
                text, stop_hit = choice.text.step(token, not stop_token, final=reason is not None)
                if stop_hit:
                    reason = "stop"
            delta = StreamDelta(
                text,
                [token],
                reason,
                [info] if info is not None else None,
                seq.num_prompt_tokens,
                seq.num_output_tokens - after,
                choice.index,
                seq.num_cached_tokens,
                request.prompt_logprobs if first else None,
                stop_token,
            )
            if reason is None:
                self._emit(request, delta)
                continue
            if after:  # a stop string ended the text before the last kept token: drop the rest
                del seq.token_ids[len(seq.token_ids) - after :]
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
            self._finish(choice, reason, delta)
            return
        if update.rejected is not None:
            log.warning("request %s: guide rejected token %d; finishing", seq.request_id, update.rejected)
            self._finish(choice, "stop")

    def _emit(self, request: _Request, item) -> None:
        request.channel.put(item)
        if request.batcher is not None:
            self._batchers.add(request.batcher)

    def _flush(self) -> None:
        """Hand the event loops their requests' deltas of this step, one wake-up each."""
        batchers, self._batchers = self._batchers, set()
        for batcher in batchers:
            batcher.flush()

    def _publish(self, seq: Sequence) -> None:
        """Offer the sequence's computed blocks for reuse: its full blocks, the rows of its last partial
        block (with a partial-block pool) and, for hybrid models, its state checkpoint."""
        partial = self.blocks.publish(seq)
        if partial is not None:
            self.runner.save_partial_block(*partial)
        state = self.blocks.state
        if state is not None and state.needs_publish(seq):
            digest = self.blocks.prefix_hashes(seq, seq.checkpoint_pos // self.blocks.block_size)[-1]
            entry = state.publish(seq, digest)
            if entry is not None:
                self.runner.save_snapshot(seq, entry)

    def _fork(self, request: _Request) -> None:
        """Start choices 1..n-1 on the prompt blocks that choice 0 has just computed."""
        leader = request.choices[0].seq
        for choice in request.choices[1:]:
            self.blocks.share_prompt(leader, choice.seq)
            self._choices[choice.seq.seq_id] = choice
            self.scheduler.add(choice.seq)

    def _finish(
        self, choice: _Choice, reason: str, delta: StreamDelta | None = None, publish: bool = True
    ) -> None:
        seq, request = choice.seq, choice.request
        if publish:
            self._publish(seq)
        self.scheduler.finish(seq, reason)
        if self.speculative is not None:
            self.speculative.release(seq)
        self._choices.pop(seq.seq_id, None)
        if delta is None:
            delta = StreamDelta(
                choice.text.pending if choice.text is not None else "",
                [],
                reason,
                None,
                seq.num_prompt_tokens,
                seq.num_output_tokens,
                choice.index,
                seq.num_cached_tokens,
            )
        if choice.index == 0 and request.finish_reason is None:
            request.finish_reason = reason
        request.num_open -= 1
        if request.num_open == 0:
            self._requests.discard(request)
            self._release_ids(request)
            if request.finish_reason == "cancelled":
                self.stats.cancelled += 1
            else:
                self.stats.completed += 1
            self._report_metrics(request)  # before the final delta: a reader that sees the end has them
        self._emit(request, delta)

    def _fail(self, request: _Request, error: BaseException) -> None:
        for choice in request.choices:
            if not choice.seq.is_finished:
                self.scheduler.finish(choice.seq, "error")
            if self.speculative is not None:
                self.speculative.release(choice.seq)
            self._choices.pop(choice.seq.seq_id, None)
        self._requests.discard(request)
        self._release_ids(request)
        request.finish_reason = "error"
        self.stats.failed += 1
        self._report_metrics(request)  # before the error reaches the reader, as in _finish
        self._emit(request, error)

    def _release_ids(self, request: _Request) -> None:
        with self._submit_lock:
            self._request_ids.difference_update(c.seq.request_id for c in request.choices)

    def _report_metrics(self, request: _Request) -> None:
        if request.on_metrics is None:
            return
        end = time.monotonic()
        first = request.first_token
        generated = sum(c.seq.num_output_tokens for c in request.choices)
        decoded = sum(max(c.seq.num_output_tokens - 1, 0) for c in request.choices)
        generation_time = end - first if first is not None else 0.0
        leader = request.choices[0].seq
        spec = SpecStats()
        for choice in request.choices:
            if choice.seq.spec_stats is not None:
                spec.add(choice.seq.spec_stats)
        metrics = GenerationMetrics(
            prompt_tokens=leader.num_prompt_tokens,
            generated_tokens=generated,
            decoded_tokens=decoded,
            time_to_first_token=(first - request.submitted) if first else 0.0,
            prefill_time=(first - request.first_scheduled) if first and request.first_scheduled else 0.0,
            generation_time=generation_time,
            decode_tokens_per_second=decoded / generation_time if decoded and generation_time > 0 else 0.0,
            reused_tokens=leader.num_cached_tokens,
            finish_reason=request.finish_reason,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_steps=spec.steps,
            spec_acceptance_rate=spec.acceptance_rate,
            spec_mean_accepted_length=spec.mean_accepted_length,
            spec_proposal_time=spec.proposal_time,
            spec_verification_time=spec.verification_time,
            forward_passes=sum(c.seq.num_forward_passes for c in request.choices),
            jump_forward_tokens=request.num_jump_forward_tokens,
        )
        try:
            request.on_metrics(metrics)
        except Exception:
            log.exception("on_metrics callback raised")


def _num_partial_snapshots(model, config: EngineConfig) -> int:
    """Entries of the partial-block snapshot pool (none for hybrid models: their recurrent state has
    snapshots at block ends only)."""
    if not config.enable_context_reuse or isinstance(model, HybridCausalLM):
        return 0
    return config.partial_kv_snapshot_pool_bytes // kv_block_bytes(
        model, config.block_size, config.kv_cache_dtype
    )


def _samples_on_device(seq: Sequence) -> bool:
    return (
        seq.matcher is None
        and not seq.num_draft_tokens
        and seq.prompt_logprobs is None
        and is_plain(seq.params)
    )


def _hybrid_state(model, tokenizer: Tokenizer, config: EngineConfig) -> HybridStateCache | None:
    """State slots (one per batch seat) and the snapshot pool of a model with recurrent layers."""
    if not isinstance(model, HybridCausalLM):
        return None
    per_snapshot = row_bytes(model.state_spec())
    pool_bytes = config.recurrent_snapshot_pool_bytes
    num_snapshots = 4 * config.max_batch_size if pool_bytes is None else pool_bytes // per_snapshot
    if not config.enable_context_reuse:
        num_snapshots = 0
    lookup = getattr(tokenizer, "token_to_id", lambda _: None)
    markers = [i for i in (lookup("<think>"),) if i is not None]
    # Draft windows keep one state per position: a chain of the speculative verify width, or a
    # jump-forward draft capped to HYBRID_MAX_JUMP_TOKENS (or that width when larger), plus the token
    # before it, for every batch seat; a step never computes more than its token budget.
    spec = config.speculative
    window = max(HYBRID_MAX_JUMP_TOKENS, spec.verify_tokens if spec is not None else 0) + 1
    budget = max(config.max_num_batched_tokens, config.block_size)
    rows = min(config.max_batch_size * window, budget)
    return HybridStateCache(config.max_batch_size, num_snapshots, config.block_size, markers, window, rows)
