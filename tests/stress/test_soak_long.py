"""The long soak: 2,000 requests at concurrency 64 over every generation endpoint, streaming and not,
30% disconnecting midway and 10% before the first token (`pytest -m slow tests/stress -s` prints the
figures). TRTEDGE_SOAK_REQUESTS / TRTEDGE_SOAK_CONCURRENCY override the size."""

from __future__ import annotations

import json
import os

import pytest

from tests.reliability import soak

NUM_REQUESTS = int(os.environ.get("TRTEDGE_SOAK_REQUESTS", "2000"))
CONCURRENCY = int(os.environ.get("TRTEDGE_SOAK_CONCURRENCY", "64"))


@pytest.mark.slow
def test_long_soak_loses_nothing_frees_everything_and_keeps_memory_flat(served):
    soak.run(served.url, served.proc.pid, 64, 16, seed=99)  # warm-up: caches, allocator pools
    report = soak.run(served.url, served.proc.pid, NUM_REQUESTS, CONCURRENCY, seed=7)
    print("soak:", json.dumps(report.as_dict()))
    assert not report.lost, report.lost[:5]
    assert report.completed + report.disconnected + report.cancelled_before_first_token == NUM_REQUESTS
    gauges = soak.settle(served.url)
    print("after:", json.dumps({k: v for k, v in gauges.items() if k.startswith("trtedge_")}))
    assert gauges["trtedge_admission_seats_in_use"] == 0
    assert gauges["trtedge_kv_cache_blocks_in_use"] == 0
    assert gauges["trtedge_requests_running"] == 0 and gauges["trtedge_requests_waiting"] == 0
    assert report.rss_growth < 0.10
    assert served.health()["status"] == "ok"
    log = served.err.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
