"""`trtedge bench` offline: the embedded SmolLM2 in-process, batch 1, with bandwidth figures."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trtedge.cli import app


def test_offline_bench_reports_latencies_and_bandwidth(tmp_path):
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "offline.json"
    args = ["bench", "--num-prompts", "3", "--input-len", "16", "--output-len", "8", "--warmup", "1"]
    args += ["--peak-bandwidth-gbs", "100", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "achieved bandwidth" in result.output and "% of 100" in result.output
    payload = json.loads(out.read_text())
    m = payload["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (3, 0, 24)
    assert m["decode_tokens_per_s"] > 0 and m["achieved_bandwidth_gbs"] > 0
    assert m["weight_bytes"] > 0 and m["peak_bandwidth_gbs"] == 100
    env = payload["environment"]
    assert env["model"] and env["fingerprint"] and env["profile"]["max_batch_size"] == 1


def test_bad_flag_names_it():
    result = CliRunner().invoke(app, ["bench", "--sweep", "batch=1,2"])
    assert result.exit_code == 2 and "--sweep" in result.output
