"""A whole benchmark: build the workload, warm up, run one load point or a sweep, summarize."""

from __future__ import annotations

import math
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from trtedge.bench import workloads
from trtedge.bench.loadgen import run_load
from trtedge.bench.metrics import RequestResult, achieved_bandwidth, peak_bandwidth_gbs, summarize

SWEEP_KNOBS = {"concurrency": "concurrency", "request_rate": "request_rate", "request-rate": "request_rate"}


@dataclass(frozen=True)
class BenchConfig:
    """What to send and how fast. ``concurrency=None`` and ``request_rate=inf`` send everything at once."""

    dataset: str = "random"  # random | fixed | path to a .jsonl / .json file | audio:FILE
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0
    concurrency: int | None = 1
    request_rate: float = math.inf
    warmup: int = 1
    sweep: tuple[str, tuple[float, ...]] | None = None
    goodput: dict[str, float] | None = None
    sampling: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")

    @property
    def max_concurrency(self) -> int | None:
        if self.sweep and self.sweep[0] == "concurrency":
            return int(max(self.sweep[1]))
        return self.concurrency


def parse_sweep(spec: str | None) -> tuple[str, tuple[float, ...]] | None:
    """``"concurrency=1,4,16"`` -> ("concurrency", (1.0, 4.0, 16.0)); also ``request_rate=...``."""
    if not spec:
        return None
    knob, _, values = spec.partition("=")
    if knob.strip() not in SWEEP_KNOBS or not values:
        raise ValueError(f"--sweep takes concurrency=1,4,16 or request_rate=1,2,4, got {spec!r}")
    try:
        points = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--sweep values must be numbers, got {values!r}") from None
    if not points or any(p <= 0 for p in points):
        raise ValueError(f"--sweep values must be > 0, got {values!r}")
    return SWEEP_KNOBS[knob.strip()], points


def make_requests(config: BenchConfig, vocab_size: int) -> list[workloads.BenchRequest]:
    c = config
    if c.dataset == "random":
        return workloads.random_requests(
            c.num_prompts, c.input_len, c.output_len, c.range_ratio, vocab_size, c.seed
        )
    if c.dataset == "fixed":
        return workloads.fixed_requests(c.num_prompts, c.input_len, c.output_len, vocab_size, c.seed)
    if c.dataset.startswith("audio:"):
        return workloads.audio_requests(c.dataset[6:], c.num_prompts, c.output_len)
    return workloads.file_requests(c.dataset, c.num_prompts, c.output_len, c.seed)


class WarmupFailed(RuntimeError):
    """A warm-up request failed; the message is its error (the server's words for an HTTP error)."""


def run_suite(
    config: BenchConfig,
    send: Callable[[workloads.BenchRequest], RequestResult],
    requests: list[workloads.BenchRequest],
    on_point: Callable[[str, int], Callable[[RequestResult], None]] | None = None,
) -> dict:
    """Warm up, then run one point or every sweep point; returns {"metrics"/"requests"} or {"sweep"}.
    ``on_point(label, total)`` may return a per-result callback (a progress bar)."""
    if config.warmup:
        warmup, _ = run_load(send, requests[: config.warmup], concurrency=1)
        failed = [r for r in warmup if not r.ok]
        if failed:  # every measured request would fail the same way: stop with the reason
            raise WarmupFailed(failed[0].error)
    if not config.sweep:
        label = _label(config.concurrency, config.request_rate)
        results, duration = _point(
            config, send, requests, config.concurrency, config.request_rate, on_point, label
        )
        return {
            "metrics": summarize(results, duration, config.goodput),
            "requests": [request_record(r) for r in results],
        }
    knob, values = config.sweep
    points = []
    for value in values:
        concurrency = int(value) if knob == "concurrency" else config.concurrency
        rate = value if knob == "request_rate" else config.request_rate
        results, duration = _point(config, send, requests, concurrency, rate, on_point, f"{knob}={value:g}")
        points.append({"value": value, "metrics": summarize(results, duration, config.goodput)})
    return {"sweep": {"knob": knob, "points": points}}


def _point(config, send, requests, concurrency, rate, on_point, label):
    callback = on_point(label, len(requests)) if on_point else None
    return run_load(
        send, requests, concurrency=concurrency, request_rate=rate, seed=config.seed, on_result=callback
    )


def _label(concurrency, rate) -> str:
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}/s"
    return f"concurrency={concurrency or 'unbounded'}, request_rate={rate_text}"


def request_record(r: RequestResult) -> dict:
    return {
        "ok": r.ok,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "start": r.start,
        "ttft": r.ttft,
        "e2e": r.e2e,
        "itls": r.itls,
        "error": r.error,
    }


def add_bandwidth(metrics: dict, requests: list[dict], llm, peak_gbs: float | None) -> None:
    """Batch-1 decode tokens/s and the GB/s it reads (weights + KV of the context per token)."""
    ok = [r for r in requests if r["ok"] and r["output_tokens"] > 1 and r["ttft"] is not None]
    decode_time = sum(r["e2e"] - r["ttft"] for r in ok)
    if not ok or decode_time <= 0:
        return
    tokens_per_s = sum(r["output_tokens"] - 1 for r in ok) / decode_time
    loaded = llm.describe()
    kv_per_token = loaded.kv_bytes_per_token
    context = sum(r["prompt_tokens"] + r["output_tokens"] / 2 for r in ok) / len(ok)
    metrics["decode_tokens_per_s"] = tokens_per_s
    metrics["weight_bytes"] = loaded.weight_bytes
    metrics["kv_bytes_per_token"] = kv_per_token
    metrics["achieved_bandwidth_gbs"] = achieved_bandwidth(
        loaded.weight_bytes, kv_per_token, context, tokens_per_s
    )
    peak = peak_gbs or peak_bandwidth_gbs(device_name(loaded.device))
    if peak:
        metrics["peak_bandwidth_gbs"] = peak
        metrics["bandwidth_utilization"] = metrics["achieved_bandwidth_gbs"] / peak


def device_name(device) -> str:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def environment(llm=None) -> dict:
    import torch

    from trtedge._version import __version__

    env = {
        "trtedge": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    if llm is not None:
        loaded = llm.describe()
        env["device"] = device_name(loaded.device)
        env["model"] = llm.model_name
        env["fingerprint"] = loaded.bundle_key
        env["profile"] = asdict(llm.config)
    return env
