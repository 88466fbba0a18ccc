"""`trtedge bench --url` against a real `trtedge serve` process (embedded SmolLM2, tiny workloads)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from tests.serve_process import ServeProcess, free_port
from trtedge.bench.backends import HttpBackend
from trtedge.bench.loadgen import run_load
from trtedge.bench.metrics import summarize
from trtedge.bench.workloads import BenchRequest, random_requests
from trtedge.cli import app


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    server = ServeProcess(
        tmp_path_factory,
        ["--max-kv-cache-capacity", "1024", "--max-input-len", "512", "--log-level", "warning"],
    )
    yield server.url
    server.stop()


def test_http_backend_streams_and_counts_tokens(server_url):
    backend = HttpBackend(server_url + "/v1", None, {"temperature": 0.0, "ignore_eos": True})
    requests = random_requests(3, 16, 6, 0.0, 49152, seed=0)
    results, duration = run_load(backend.send, requests, concurrency=2)
    backend.close()
    assert all(r.ok for r in results), [r.error for r in results]
    for r in results:
        assert r.prompt_tokens == 16 and r.output_tokens == 6
        assert 0 < r.ttft <= r.e2e and len(r.chunk_times) >= 2
    m = summarize(results, duration)
    assert (m["completed"], m["failed"]) == (3, 0) and m["total_output_tokens"] == 18


def test_failed_requests_are_counted_not_hidden(server_url):
    backend = HttpBackend(server_url, None, {"ignore_eos": True})
    too_long = BenchRequest(list(range(100, 700)), 600, 4)  # 600 tokens > --max-input-len 512
    fine = BenchRequest(list(range(100, 110)), 10, 4)
    results, duration = run_load(backend.send, [fine, too_long, fine], concurrency=1)
    backend.close()
    assert [r.ok for r in results] == [True, False, True]
    assert "HTTP 400" in results[1].error
    m = summarize(results, duration)
    assert (m["completed"], m["failed"]) == (2, 1) and sum(m["errors"].values()) == 1


def test_unreachable_server_fails_every_request():
    backend = HttpBackend(f"http://127.0.0.1:{free_port()}", "some-model", {})
    results, _ = run_load(backend.send, [BenchRequest([100], 1, 2)] * 2, concurrency=1)
    assert [r.ok for r in results] == [False, False] and all("Connect" in r.error for r in results)


def test_cli_bench_url_writes_json(server_url, tmp_path):
    out = tmp_path / "run.json"
    args = ["bench", "--url", server_url, "--num-prompts", "3", "--input-len", "16", "--output-len", "8"]
    args += ["--concurrency", "2", "--warmup", "1", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "output throughput" in result.output
    payload = json.loads(out.read_text())
    assert payload["config"]["mode"] == "url" and payload["config"]["concurrency"] == 2
    assert payload["metrics"]["completed"] == 3 and payload["metrics"]["total_output_tokens"] == 24
    assert len(payload["requests"]) == 3 and payload["environment"]["trtedge"]
    assert payload["environment"]["server"]["capabilities"]["max_input_len"] == 512


def test_cli_sweep_over_request_rate(server_url, tmp_path):
    out = tmp_path / "sweep.json"
    args = ["bench", "--url", server_url, "--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
    args += ["--sweep", "request_rate=5,50", "--warmup", "0", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    points = json.loads(out.read_text())["sweep"]["points"]
    assert [p["value"] for p in points] == [5, 50] and all(p["metrics"]["completed"] == 2 for p in points)


def test_cli_exits_1_when_every_request_fails_and_still_reports_them(tmp_path):
    out = tmp_path / "down.json"
    args = ["bench", "--url", f"http://127.0.0.1:{free_port()}", "--served-model-name", "m"]
    args += ["--num-prompts", "2", "--sweep", "request_rate=50", "--warmup", "0", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "every request failed" in result.output
    payload = json.loads(out.read_text())
    assert payload["config"]["concurrency"] is None  # a rate sweep alone does not cap concurrency
    (point,) = payload["sweep"]["points"]
    assert (point["metrics"]["completed"], point["metrics"]["failed"]) == (0, 2)


def test_a_failing_warm_up_stops_the_run_with_the_server_s_message(server_url):
    args = ["bench", "--url", server_url, "--served-model-name", "nope", "--num-prompts", "2"]
    result = CliRunner().invoke(app, [*args, "--input-len", "8", "--output-len", "4"])
    assert result.exit_code == 1, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("trtedge bench:")]
    assert "warm-up request failed" in line and "HTTP 404" in line and "nope" in line
    assert '{"' not in line  # the server's message, not its JSON
    assert "TTFT" not in result.output and "throughput" not in result.output


def test_a_run_where_every_request_failed_shows_no_figures(server_url):
    args = [
        "bench",
        "--url",
        server_url,
        "--served-model-name",
        "nope",
        "--num-prompts",
        "2",
        "--warmup",
        "0",
    ]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--input-len", "8", "--output-len", "4"])
    assert result.exit_code == 1, result.output
    assert "every request failed" in result.stderr
    assert "requests ok / failed" in result.stdout and "failed x2" in result.stdout
    assert "HTTP 404" in result.stdout and '{"' not in result.stdout
    assert "TTFT" not in result.stdout and "throughput" not in result.stdout
    assert not re.search(r"\s0\.0\s", result.stdout)  # no latency of zero for what never completed
