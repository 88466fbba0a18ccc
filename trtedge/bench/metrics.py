"""Per-request timings and the run's summary (vLLM benchmark_serving's definitions)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    """What one request did. Times are seconds from its own start; ``chunk_times`` holds when each
    streamed piece carrying tokens arrived, so ``ttft = chunk_times[0]`` and the ITLs are the gaps."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # since the run started
    e2e: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Decode time per output token after the first; None with fewer than 2 tokens."""
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None) -> dict:
    """Every figure of a run. Latencies are in milliseconds; failed requests count in ``failed`` and
    nowhere else. ``goodput`` maps ttft/tpot/e2e to an SLO in ms: requests meeting all of them per second."""
    ok = [r for r in results if r.ok]
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
    }
    out["request_throughput"] = len(ok) / duration if duration > 0 else 0.0
    out["input_throughput"] = out["total_input_tokens"] / duration if duration > 0 else 0.0
    out["output_throughput"] = out["total_output_tokens"] / duration if duration > 0 else 0.0
    samples = latency_samples(ok)
    for name in LATENCIES:
        out[f"{name}_ms"] = describe([s * 1000 for s in samples[name]])
    if goodput:
        good = [r for r in ok if _meets(r, goodput)]
        out["goodput"] = len(good) / duration if duration > 0 else 0.0
        out["goodput_slo_ms"] = dict(goodput)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    out["errors"] = errors
    return out


def latency_samples(ok: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds: one TTFT, TPOT and E2E per request (TPOT only with >= 2 tokens); every ITL gap."""
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2e": [r.e2e for r in ok],
    }


def describe(values: list[float]) -> dict:
    """mean, median, p90, p99 (linear interpolation, as numpy and vLLM), min, max; zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "min": 0.0, "max": 0.0, "count": 0}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, PERCENTILES).tolist()
    return {
        "mean": float(a.mean()),
        "median": p50,
        "p90": p90,
        "p99": p99,
        "min": float(a.min()),
        "max": float(a.max()),
        "count": len(values),
    }


def _meets(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
    return all(values[k] is not None and values[k] * 1000 <= v for k, v in slo_ms.items())


def parse_goodput(spec: list[str] | None) -> dict[str, float] | None:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not spec:
        return None
    slo = {}
    for item in spec:
        for part in item.split(","):
            name, _, value = part.partition(":")
            if name not in ("ttft", "tpot", "e2e") or not value:
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {part!r}")
            slo[name] = float(value)
    return slo


# ---- achieved bandwidth (gpt-fast style) --------------------------------------------------------

# Peak memory bandwidth in GB/s, matched against the device name (first match wins).
PEAK_BANDWIDTH_GBS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,
    "H20": 4000,
    "GH200": 4000,
    "B200": 8000,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "A10G": 600,
    "A10": 600,
    "L40S": 864,
    "L40": 864,
    "L4": 300,
    "RTX 4090": 1008,
    "RTX 3090": 936,
    "V100": 900,
    "T4": 320,
    "Orin": 205,
    "Thor": 273,
}


def peak_bandwidth_gbs(device_name: str) -> float | None:
    for key, gbs in PEAK_BANDWIDTH_GBS.items():
        if key.lower() in device_name.lower():
            return float(gbs)
    return None


def achieved_bandwidth(
    weight_bytes: int, kv_bytes_per_token: int, mean_context: float, decode_tokens_per_s: float
) -> float:
    """GB/s a batch-1 decode reads: all weights plus the KV cache of the context, once per token."""
    return (weight_bytes + kv_bytes_per_token * mean_context) * decode_tokens_per_s / 1e9
