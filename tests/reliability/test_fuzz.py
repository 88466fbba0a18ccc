"""Fuzzing a real `trtedge serve` from its /openapi.json (the short run; tests/stress has the long one)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.reliability import fuzz
from tests.reliability.common import metrics

NUM_REQUESTS = 120  # every kind of case (valid, raw, get, method, invalid:*) is drawn at this size


@pytest.mark.filterwarnings("error::hypothesis.errors.HypothesisDeprecationWarning")
def test_the_request_strategy_draws_only_through_hypothesis():
    # Every random choice comes from Hypothesis, so a derandomized run replays and warns of nothing.
    from trtedge.server.openapi import openapi_schema

    drawn = []

    @settings(max_examples=200, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(fuzz.cases(openapi_schema(), "served-model"))
    def draw(case):
        drawn.append(case)

    draw()
    kinds = {kind for *_, kind in drawn}
    assert {"valid", "get", "method"} <= kinds and any(k.startswith("invalid:") for k in kinds)


def test_fuzzed_requests_get_no_5xx_and_documented_4xx(served):
    report = fuzz.run(served.url, NUM_REQUESTS, derandomize=True)
    print("fuzz:", json.dumps(report))
    assert report["requests"] >= NUM_REQUESTS
    assert set(report["by_kind"]) >= {"valid", "raw", "get", "method"}
    health = httpx.get(f"{served.url}/health", timeout=10).json()
    assert health["status"] == "ok"
    gauges = metrics(served.url)
    assert gauges["trtedge_admission_seats_in_use"] == 0 and gauges["trtedge_kv_cache_blocks_in_use"] == 0
