"""The short soak (tests/stress has the 2,000-request one): disconnects and early cancels leave the
server holding nothing, and every request that stayed got a full answer."""

from __future__ import annotations

import json

from tests.reliability import soak

NUM_REQUESTS = 64  # the first 32 (one per worker) already hold 3 early cancels and 11 disconnects (seed 1)
CONCURRENCY = 32


def test_soak_with_disconnects_loses_nothing_and_frees_everything(served):
    report = soak.run(served.url, served.proc.pid, NUM_REQUESTS, CONCURRENCY, seed=1)
    print("soak:", json.dumps(report.as_dict()))
    assert not report.lost, report.lost[:5]
    assert report.completed + report.disconnected + report.cancelled_before_first_token == NUM_REQUESTS
    assert report.disconnected > 0 and report.cancelled_before_first_token > 0
    gauges = soak.settle(served.url)
    assert gauges["trtedge_admission_seats_in_use"] == 0
    assert gauges["trtedge_kv_cache_blocks_in_use"] == 0
    assert gauges["trtedge_requests_running"] == 0 and gauges["trtedge_requests_waiting"] == 0
    assert served.health()["status"] == "ok"
    log = served.err.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
