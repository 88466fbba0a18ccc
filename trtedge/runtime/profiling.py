"""Aggregate profiling over runs (``LLM.set_profiling_enabled``): prefill and generation counters, as
the TensorRT Edge-LLM runtime's ``LLMPrefillMetrics`` / ``LLMGenerationMetrics`` keep them, and the
time of each engine stage. Device stages are timed with CUDA events on a GPU (read back without
stalling the step: an event pair is resolved once the GPU has passed it), with the wall clock on
the CPU. Off, a stage costs one flag test. Independent of the per-request ``on_metrics`` figures.

The engine thread records; any thread may read a snapshot (``metrics()``) or toggle ``enabled``."""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

# Stage names, as the Edge-LLM runtime names its profiling stages where it has one.
PREFILL, GENERATION, SPECULATIVE, MULTIMODAL, SCHEDULE = (
    "llm_prefill",
    "llm_generation",
    "spec_decode",
    "multimodal_processing",
    "schedule",
)


@dataclass(frozen=True)
class StageTiming:
    """One stage: how many times it ran and the seconds it took in all (GPU time on CUDA)."""

    runs: int = 0
    total_time: float = 0.0

    @property
    def mean_time(self) -> float:
        return self.total_time / self.runs if self.runs else 0.0


@dataclass(frozen=True)
class LLMPrefillMetrics:
    """Model steps that computed prompt tokens (``total_runs``), the prompt tokens they computed, the
    prompt tokens taken from the context cache instead, and their time in seconds."""

    total_runs: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    total_time: float = 0.0


@dataclass(frozen=True)
class LLMGenerationMetrics:
    """Decode steps (speculative verification steps included), the output tokens generated (summed
    over sequences and runs, the token sampled at prefill included), and their time in seconds."""

    total_runs: int = 0
    generated_tokens: int = 0
    total_time: float = 0.0


@dataclass(frozen=True)
class ProfilingMetrics:
    """What ``LLM.get_profiling_metrics()`` returns: the totals while profiling was on. ``stages``:
    stage name -> ``StageTiming`` (llm_prefill, llm_generation, spec_decode, multimodal_processing:
    device time; schedule: host time); ``timer``: ``"cuda_events"`` or ``"wall_clock"``."""

    enabled: bool
    timer: str
    prefill: LLMPrefillMetrics
    generation: LLMGenerationMetrics
    stages: dict[str, StageTiming] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _Stage:
    __slots__ = ("runs", "seconds")

    def __init__(self) -> None:
        self.runs = 0
        self.seconds = 0.0


class Profiler:
    def __init__(self, device=None):
        self.enabled = False
        self._cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
        self._lock = threading.Lock()
        self._pending: list[tuple[str, object, object]] = []  # (stage, start event, end event)
        self.reset()

    @property
    def timer(self) -> str:
        return "cuda_events" if self._cuda else "wall_clock"

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
            self._stages: dict[str, _Stage] = {}
            self._counts = dict(
                prefill_runs=0, computed_tokens=0, reused_tokens=0, generation_runs=0, generated_tokens=0
            )

    # ---- recording (the engine thread) ---------------------------------------------------------
    @contextmanager
    def stage(self, name: str, on_device: bool = True):
        """Time the body as one run of stage ``name`` (on the device's stream when ``on_device``)."""
        if not self.enabled:
            yield
            return
        if self._cuda and on_device:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            with self._lock:
                self._pending.append((name, start, end))
                self._resolve(wait=False)
            return
        t0 = time.perf_counter()
        yield
        self._add(name, time.perf_counter() - t0)

    def model_step(self, seqs, num_tokens) -> str:
        """Count a model step over ``seqs`` (before it runs): its prompt tokens, and the tokens the
        context cache gave the sequences whose prompt starts here. Returns the stage it belongs to."""
        computed = reused = 0
        for seq, n in zip(seqs, num_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                if seq.num_computed_tokens == seq.num_cached_tokens:  # its first chunk
                    reused += seq.num_cached_tokens
        if computed:
            self.count(prefill_runs=1, computed_tokens=computed, reused_tokens=reused)
            return PREFILL
        self.count(generation_runs=1)
        return GENERATION

    def count(self, **counts: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            for key, value in counts.items():
                self._counts[key] += value

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            stage = self._stages.get(name)
            if stage is None:
                stage = self._stages[name] = _Stage()
            stage.runs += 1
            stage.seconds += seconds

    def _resolve(self, wait: bool) -> None:
        """Fold in the event pairs the GPU has passed (all of them, waiting, when ``wait``); the lock is held."""
        keep = []
        for name, start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                keep.append((name, start, end))
                continue
            stage = self._stages.get(name)
            if stage is None:
                stage = self._stages[name] = _Stage()
            stage.runs += 1
            stage.seconds += start.elapsed_time(end) / 1000.0
        self._pending = keep

    # ---- reading (any thread) ------------------------------------------------------------------
    def metrics(self) -> ProfilingMetrics:
        with self._lock:
            if self._pending:
                self._resolve(wait=True)
            c = dict(self._counts)
            stages = {name: StageTiming(s.runs, s.seconds) for name, s in self._stages.items()}
        none = StageTiming()
        return ProfilingMetrics(
            enabled=self.enabled,
            timer=self.timer,
            prefill=LLMPrefillMetrics(
                c["prefill_runs"],
                c["computed_tokens"],
                c["reused_tokens"],
                stages.get(PREFILL, none).total_time,
            ),
            generation=LLMGenerationMetrics(
                c["generation_runs"],
                c["generated_tokens"],
                stages.get(GENERATION, none).total_time + stages.get(SPECULATIVE, none).total_time,
            ),
            stages=stages,
        )


class GcPauses:
    """The seconds this process spends in the garbage collector, by generation (through
    ``gc.callbacks``): the engine-core process keeps one, as a step stalls while a collection runs."""

    def __init__(self, frozen: int = 0) -> None:
        self.frozen = frozen  # objects moved out of the collector's reach (gc.freeze) before counting
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started

    def as_dict(self) -> dict:
        return {
            "collections": list(self.collections),
            "seconds": [round(t, 4) for t in self.seconds],
            "frozen_objects": self.frozen,
        }

    def close(self) -> None:
        gc.callbacks.remove(self._callback)
