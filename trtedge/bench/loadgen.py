"""The load generator: closed loop (``concurrency``), open loop (Poisson ``request_rate``), or both."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from trtedge.bench.metrics import RequestResult
from trtedge.bench.workloads import BenchRequest

MAX_THREADS = 512


def run_load(
    send: Callable[[BenchRequest], RequestResult],
    requests: list[BenchRequest],
    *,
    concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    on_result: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request and return their results (in workload order) and the run's duration.

    Arrivals are a seeded Poisson process at ``request_rate`` per second (all at once when infinite);
    at most ``concurrency`` requests are in flight (unbounded when None). A request's clock starts
    when it is sent, after any wait for a free slot, as in vLLM's benchmark_serving.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    rng = np.random.default_rng(seed)
    num_threads = min(concurrency or len(requests), len(requests), MAX_THREADS) or 1
    results: list[RequestResult | None] = [None] * len(requests)
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(i: int, req: BenchRequest) -> None:
        sent = time.perf_counter() - t0
        result = send(req)
        result.start = sent
        results[i] = result
        if on_result is not None:
            with lock:
                on_result(result)

    arrival = 0.0
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="bench")
    try:
        for i, req in enumerate(requests):
            if math.isfinite(request_rate):
                delay = t0 + arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                arrival += rng.exponential(1.0 / request_rate)
            pool.submit(one, i, req)
    except BaseException:  # Ctrl-C: requests not yet sent are dropped; those in flight finish
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    duration = time.perf_counter() - t0
    return [r if r is not None else RequestResult(error="not run") for r in results], duration
