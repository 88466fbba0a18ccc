"""Fault injection against a real `trtedge serve`: a model step that raises fails only the requests
in it (500 engine_error, or an SSE error event then [DONE]); the engine restarts and serves the
others; /health counts restarts; an engine that cannot restart answers 503 engine_unavailable.

The hook is ``$TRTEDGE_TEST_FAULT`` (trtedge/runtime/faults.py): ``token=ID`` makes every step that
computes a prompt holding token ID raise, so the "poisoned" requests are known in advance.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.reliability.common import CHAT, COMPLETIONS, assert_error, metrics, stream_error
from tests.serve_process import ServeProcess

POISON = 48999
ARGS = ["--max-kv-cache-capacity", "1024", "--max-input-len", "512", "--log-level", "warning"]


def _serve(tmp_path_factory, monkeypatch, fault: str, *extra: str) -> ServeProcess:
    monkeypatch.setenv("TRTEDGE_TEST_FAULT", fault)
    return ServeProcess(tmp_path_factory, [*ARGS, *extra])


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_a_failed_step_fails_its_request_and_the_restarted_engine_serves_the_rest(
    tmp_path_factory, monkeypatch
):
    # batch 1: each request runs alone, so a poisoned step holds only the poisoned request
    server = _serve(
        tmp_path_factory,
        monkeypatch,
        f"token={POISON}",
        "--enable-in-flight-batching",
        "--max-batch-size",
        "1",
    )
    try:
        poisoned = {"prompt": [1, POISON, 5], "max_tokens": 4}
        hello = [{"role": "user", "content": "Say hello."}]
        jobs = [
            (COMPLETIONS, poisoned),
            (COMPLETIONS, {**poisoned, "stream": True}),
            (CHAT, {"messages": hello, "max_tokens": 8, "temperature": 0}),
            (CHAT, {"messages": hello, "max_tokens": 8, "temperature": 0, "stream": True}),
            (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
            (COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True, "ignore_eos": True}),
        ]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            replies = list(pool.map(lambda job: _post(server.url, *job), jobs))

        assert_error(replies[0], 500, "engine_error")
        assert replies[1].status_code == 200 and stream_error(replies[1].text)["code"] == "engine_error"
        for (_, body), reply in zip(jobs[2:], replies[2:]):
            assert reply.status_code == 200, reply.text
            if body.get("stream"):
                assert stream_error(reply.text) is None and '"finish_reason":"' in reply.text
            else:
                assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")

        health = server.health()
        assert health["status"] == "ok" and health["engine"]["restarts"] == 2
        gauges = metrics(server.url)
        assert gauges["trtedge_engine_restarts"] == 2 and gauges["trtedge_engine_up"] == 1
        assert gauges["trtedge_kv_cache_blocks_in_use"] == 0 and gauges["trtedge_admission_seats_in_use"] == 0
        later = _post(server.url, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
        assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    log = server.err.read_text()
    assert "engine restarted (2 so far)" in log and "injected fault" in log


def test_an_engine_that_cannot_restart_answers_503_engine_unavailable(tmp_path_factory, monkeypatch):
    server = _serve(tmp_path_factory, monkeypatch, f"token={POISON},restart=fail")
    try:
        assert_error(
            _post(server.url, COMPLETIONS, {"prompt": [POISON], "max_tokens": 2}), 500, "engine_error"
        )
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "error" and "cannot restart" in body["reason"]
        assert body["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{server.url}/health/ready", timeout=10).status_code == 503
        for path, body in (
            (CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
            (COMPLETIONS, {"prompt": "hi", "stream": True}),
        ):
            error = assert_error(_post(server.url, path, body), 503, "engine_unavailable")
            assert "cannot restart" in error["message"]
        assert metrics(server.url)["trtedge_engine_up"] == 0
    finally:
        server.stop()


def test_fault_spec_is_validated():
    from trtedge.runtime.faults import FaultInjector

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRTEDGE_TEST_FAULT", "step=sometimes")
        with pytest.raises(ValueError, match="unknown fault 'step=sometimes'"):
            FaultInjector.from_env()
        mp.setenv("TRTEDGE_TEST_FAULT", "step=2, token=9 ,restart=fail")
        faults = FaultInjector.from_env()
    assert (faults.step, faults.poison_token, faults.fail_restart) == (2, 9, True)
