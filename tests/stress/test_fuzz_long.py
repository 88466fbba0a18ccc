"""The long fuzz run: 2,000+ requests generated from /openapi.json against a real `trtedge serve`
(`pytest -m slow tests/stress -s` prints the counts). TRTEDGE_FUZZ_REQUESTS sets the number."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.reliability import fuzz
from tests.reliability.common import metrics

NUM_REQUESTS = int(os.environ.get("TRTEDGE_FUZZ_REQUESTS", "2400"))


@pytest.mark.slow
def test_long_fuzz_gets_no_5xx_and_documented_4xx(served):
    report = fuzz.run(served.url, NUM_REQUESTS, derandomize=False)
    print("fuzz:", json.dumps(report))
    assert report["requests"] >= NUM_REQUESTS
    assert httpx.get(f"{served.url}/health", timeout=10).json()["status"] == "ok"
    gauges = metrics(served.url)
    assert gauges["trtedge_admission_seats_in_use"] == 0 and gauges["trtedge_kv_cache_blocks_in_use"] == 0
    assert "Traceback" not in served.err.read_text()
