"""Metrics on fake streams with known timings, checked against hand-computed values."""

from __future__ import annotations

import json
import sys
import time

import pytest
from typer.testing import CliRunner

from trtedge.bench import report
from trtedge.bench.backends import OfflineBackend, normalize_url
from trtedge.bench.loadgen import run_load
from trtedge.bench.metrics import RequestResult, describe, parse_goodput, summarize
from trtedge.bench.workloads import BenchRequest
from trtedge.cli import app
from trtedge.runtime.output import StreamDelta


def test_one_request_ttft_itl_tpot():
    r = RequestResult(ok=True, output_tokens=4, e2e=0.30, chunk_times=[0.10, 0.15, 0.25, 0.30])
    assert r.ttft == 0.10
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])
    assert r.tpot == pytest.approx((0.30 - 0.10) / 3)


def test_percentiles_match_hand_values():
    d = describe([4.0, 1.0, 3.0, 2.0])
    # linear interpolation between order statistics: position p/100 * (n - 1)
    assert d["mean"] == 2.5 and d["median"] == 2.5
    assert d["p90"] == pytest.approx(3.7) and d["p99"] == pytest.approx(3.97)
    assert (d["min"], d["max"], d["count"]) == (1.0, 4.0, 4)


def test_summary_counts_failures_and_excludes_them_from_latencies():
    ok1 = RequestResult(ok=True, prompt_tokens=10, output_tokens=3, e2e=0.4, chunk_times=[0.2, 0.3, 0.4])
    ok2 = RequestResult(ok=True, prompt_tokens=20, output_tokens=1, e2e=0.1, chunk_times=[0.1])
    bad = RequestResult(ok=False, prompt_tokens=5, e2e=0.01, error="HTTP 400: too long")
    m = summarize([ok1, bad, ok2], duration=2.0, goodput={"ttft": 150})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["errors"] == {"HTTP 400: too long": 1}
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 4
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)
    assert m["itl_ms"]["count"] == 2 and m["itl_ms"]["mean"] == pytest.approx(100.0)
    assert m["tpot_ms"]["count"] == 1 and m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["e2e_ms"]["p90"] == pytest.approx(100 + 0.9 * 300)
    assert m["goodput"] == 0.5  # only ok2 meets ttft <= 150 ms


def test_goodput_spec():
    assert parse_goodput(["ttft:500", "tpot:50,e2e:2000"]) == {"ttft": 500, "tpot": 50, "e2e": 2000}
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(["latency:5"])


class FakeLLM:
    """generate_stream yields one token every ``gap`` seconds after ``first`` seconds; prompts
    containing the id 13 fail the way a too-long prompt does."""

    def __init__(self, first=0.05, gap=0.02):
        self.first, self.gap = first, gap

    def generate_stream(self, prompt, params):
        if 13 in prompt:
            raise ValueError("prompt too long")
        return _Stream(self._deltas(len(prompt), params.max_tokens))

    def _deltas(self, num_prompt, max_tokens):
        time.sleep(self.first)
        for i in range(max_tokens):
            if i:
                time.sleep(self.gap)
            last = i == max_tokens - 1
            yield StreamDelta("x", [i], "length" if last else None, prompt_tokens=num_prompt)


class _Stream:
    def __init__(self, gen):
        self.gen = gen

    def __iter__(self):
        return self.gen

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_offline_backend_on_a_fake_stream_with_known_timings():
    backend = OfflineBackend(FakeLLM(first=0.05, gap=0.02), {"temperature": 0.0})
    requests = [BenchRequest([1, 2, 3], 3, 5), BenchRequest([13, 2], 2, 5), BenchRequest([4, 5], 2, 5)]
    results, duration = run_load(backend.send, requests, concurrency=1)
    ok = [r for r in results if r.ok]
    assert [r.ok for r in results] == [True, False, True]
    assert "prompt too long" in results[1].error
    for r in ok:
        assert r.output_tokens == 5 and len(r.chunk_times) == 5
        # The fake sleeps at least this long; a loaded machine may add to it, never take away.
        assert 0.049 <= r.ttft < r.e2e
        assert len(r.itls) == 4 and all(itl >= 0.019 for itl in r.itls)
        assert r.e2e >= 0.049 + 4 * 0.019
    assert results[2].start >= results[0].start + results[0].e2e  # closed loop, one at a time
    m = summarize(results, duration)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 5 and m["total_output_tokens"] == 10


def test_poisson_arrivals_are_seeded_and_spread():
    def send(req):
        return RequestResult(ok=True, output_tokens=1, chunk_times=[0.0])

    requests = [BenchRequest([1], 1, 1)] * 6
    results, duration = run_load(send, requests, request_rate=50.0, seed=3)
    starts = [r.start for r in results]
    assert starts == sorted(starts) and 0.01 < duration < 2.0


def test_url_normalization():
    assert normalize_url("http://h:8000/v1/") == normalize_url("http://h:8000") == "http://h:8000"


def _payload(throughput: float, ttft: float) -> dict:
    r = RequestResult(
        ok=True, prompt_tokens=4, output_tokens=2, e2e=ttft + 0.01, chunk_times=[ttft, ttft + 0.01]
    )
    m = summarize([r], duration=2 / throughput)
    return {"config": {"title": "t"}, "metrics": m, "requests": []}


def test_compare_prints_ratios(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_payload(100.0, 0.1)))
    b.write_text(json.dumps(_payload(200.0, 0.05)))
    result = CliRunner().invoke(app, ["bench", "compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "output_throughput" in result.output and "2.00x" in result.output
    assert "ttft_ms.mean" in result.output and "0.50x" in result.output


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    why = report.plot(tmp_path / "p.png", _payload(1.0, 0.1))
    assert "pip install 'trtedge[bench]'" in why
    assert not (tmp_path / "p.png").exists()


def test_the_plot_hint_keeps_its_extra_when_printed(tmp_path, monkeypatch):
    # rich read "[bench]" in "pip install 'trtedge[bench]'" as markup and printed "pip install 'trtedge'"
    import io

    from rich.console import Console

    from trtedge.commands.bench import write_outputs

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = io.StringIO()
    write_outputs(_payload(1.0, 0.1), None, str(tmp_path / "p.png"), Console(file=out, width=200))
    assert "pip install 'trtedge[bench]' to draw --plot" in out.getvalue()


def test_a_run_with_no_completed_request_shows_counts_and_errors_only():
    import io

    from rich.console import Console

    failed = [RequestResult(error="HTTP 404: the model 'nope' does not exist [x]")] * 2
    m = summarize(failed, 1.0)
    out = io.StringIO()
    report.print_tables(report.run_tables(m, "t"), Console(file=out, width=200))
    text = out.getvalue()
    assert "0 / 2" in text and "failed x2" in text and "does not exist [x]" in text
    assert "TTFT" not in text and "throughput" not in text


def test_concurrency_caps_requests_in_flight():
    import threading

    lock = threading.Lock()
    state = {"now": 0, "most": 0}

    def send(req):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        return RequestResult(ok=True, output_tokens=1, chunk_times=[0.02], e2e=0.02)

    results, _ = run_load(send, [BenchRequest([1], 1, 1)] * 9, concurrency=3)
    assert len(results) == 9 and all(r.ok for r in results)
    assert state["most"] == 3
