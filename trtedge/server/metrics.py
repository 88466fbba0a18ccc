"""Prometheus metrics for the server, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trtedge.llm_metrics import ContextCacheMetrics
from trtedge.runtime.profiling import ProfilingMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], dict],
        num_queued: Callable[[], int],
        num_seated: Callable[[], int] = lambda: 0,
        cache_stats: Callable[[], ContextCacheMetrics] | None = None,
        profiling: Callable[[], ProfilingMetrics] | None = None,
    ):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "trtedge_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.queue_time = Histogram(
            "trtedge_request_queue_seconds",
            "Time from arrival to admission",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "trtedge_time_to_first_token_seconds",
            "Time from arrival to the first output token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "trtedge_inter_token_latency_seconds",
            "Time between successive output deltas of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("trtedge_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("trtedge_generation_tokens", "Output tokens generated", registry=r)
        Gauge("trtedge_requests_running", "Requests generating in the engine", registry=r).set_function(
            lambda: stats()["running"]
        )
        Gauge(
            "trtedge_requests_waiting", "Requests waiting in the server queue or the engine", registry=r
        ).set_function(lambda: stats()["waiting"] + num_queued())
        Gauge("trtedge_kv_cache_blocks_in_use", "KV cache blocks in use", registry=r).set_function(
            lambda: _blocks_in_use(stats())
        )
        Gauge("trtedge_kv_cache_blocks_total", "KV cache blocks in the pool", registry=r).set_function(
            lambda: stats()["kv_blocks_total"]
        )

        Gauge(
            "trtedge_admission_seats_in_use", "Admission seats held by requests being answered", registry=r
        ).set_function(num_seated)
        Gauge("trtedge_engine_steps", "Engine steps run so far", registry=r).set_function(
            lambda: stats()["steps"]
        )
        Gauge(
            "trtedge_engine_preemptions", "Requests preempted (their KV freed, recomputed later)", registry=r
        ).set_function(lambda: stats()["preemptions"])
        Gauge(
            "trtedge_engine_restarts", "Times the engine restarted after a failed step", registry=r
        ).set_function(lambda: stats()["restarts"])
        Gauge(
            "trtedge_engine_up", "1 while the engine serves, 0 once it has failed", registry=r
        ).set_function(lambda: int(stats()["engine_error"] is None))
        if cache_stats is not None:
            Gauge(
                "trtedge_prefix_cache_hits", "Requests that reused cached prompt blocks", registry=r
            ).set_function(lambda: cache_stats().hits)
            Gauge(
                "trtedge_prefix_cache_reused_tokens", "Prompt tokens taken from the prefix cache", registry=r
            ).set_function(lambda: cache_stats().reused_tokens)

        if profiling is not None:
            r.register(_ProfilingCollector(profiling))

        if stats().get("mm_embedding_cache") is not None:  # vision models: the encoder's embedding cache
            for key, text in (("hits", "Media taken from"), ("misses", "Media not found in")):
                Gauge(
                    f"trtedge_mm_embedding_cache_{key}",
                    f"{text} the vision encoder's embedding cache",
                    registry=r,
                ).set_function(lambda key=key: stats()["mm_embedding_cache"][key])

        if stats().get("ple_cache") is not None:  # Gemma 3n / Gemma 4: the per-layer embedding pool
            for key, text in (
                ("hits", "Distinct per-layer embedding rows a step found in the device pool"),
                ("misses", "Distinct per-layer embedding rows a step copied into the device pool"),
                ("evictions", "Per-layer embedding rows evicted from the device pool"),
                ("bytes_loaded", "Bytes of per-layer embedding rows copied from the host"),
                ("split_steps", "Steps run in pieces to fit the per-layer embedding pool"),
                ("device_bytes", "Bytes of the per-layer embedding table or pool on the device"),
                ("staging_bytes", "Bytes of the per-layer embedding host staging buffer"),
            ):
                Gauge(f"trtedge_ple_cache_{key}", text, registry=r).set_function(
                    lambda key=key: stats()["ple_cache"][key]
                )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ProfilingCollector:
    """The engine's profiling totals (``LLM.set_profiling_enabled``, ``serve --enable-profiling``)."""

    def __init__(self, read: Callable[[], ProfilingMetrics]):
        self.read = read

    def collect(self):
        m = self.read()
        yield GaugeMetricFamily(
            "trtedge_profiling_enabled", "1 while engine profiling is on", value=int(m.enabled)
        )
        p, g = m.prefill, m.generation
        for name, text, value in (
            ("prefill_runs", "Model steps that computed prompt tokens", p.total_runs),
            ("prefill_computed_tokens", "Prompt tokens computed", p.computed_tokens),
            ("prefill_reused_tokens", "Prompt tokens taken from the context cache", p.reused_tokens),
            ("prefill_seconds", "Time of the prefill steps", p.total_time),
            ("generation_runs", "Decode steps, speculative ones included", g.total_runs),
            ("generated_tokens", "Output tokens, summed over sequences and steps", g.generated_tokens),
            ("generation_seconds", "Time of the decode steps", g.total_time),
        ):
            yield CounterMetricFamily(f"trtedge_profile_{name}", f"{text} while profiling", value=value)
        runs = CounterMetricFamily(
            "trtedge_profile_stage_runs", "Runs of each engine stage while profiling", labels=["stage"]
        )
        seconds = CounterMetricFamily(
            "trtedge_profile_stage_seconds",
            f"Time of each engine stage while profiling ({m.timer}; schedule: host time)",
            labels=["stage"],
        )
        for stage, timing in sorted(m.stages.items()):
            runs.add_metric([stage], timing.runs)
            seconds.add_metric([stage], timing.total_time)
        yield runs
        yield seconds


def _blocks_in_use(stats: dict) -> int:
    return stats["kv_blocks_total"] - stats["kv_blocks_free"]
