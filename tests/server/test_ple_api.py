"""The per-layer embedding pool of a served Gemma 4 (tiny, random): its counters in /health and
/metrics, and the ``--ple-*`` flags of ``trtedge serve``."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from typer.testing import CliRunner

from trtedge.cli import app as cli
from trtedge.server.app import build_app

pytest.importorskip("transformers")


def get(app, path: str, **kwargs) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if "json" in kwargs:
                return await client.post(path, **kwargs)
            return await client.get(path)

    return asyncio.run(main())


def test_health_and_metrics_show_the_pool_counters(tmp_path):
    from tests.tiny import make_tiny_ple_checkpoint
    from trtedge import LLM

    path = make_tiny_ple_checkpoint(tmp_path / "m", "gemma4")
    ple = {"residency": "cached", "cache_slots": 9}
    with LLM(str(path), device="cpu", dtype="float32", max_kv_cache_capacity=128, ple_config=ple) as llm:
        server = build_app(llm)
        words = " ".join(f"w{i}" for i in range(10, 40))  # 30 distinct tokens, 8 rows in the pool
        answer = get(server, "/v1/completions", json={"prompt": words, "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        pool = get(server, "/health").json()["engine"]["ple_cache"]
        metrics = get(server, "/metrics").text
    assert pool["residency"] == "cached" and pool["slots"] == 9
    assert pool["misses"] >= 30 and pool["split_steps"] >= 1 and pool["rows_resident"] <= 8
    assert f"trtedge_ple_cache_misses {float(pool['misses'])}" in metrics
    assert f"trtedge_ple_cache_device_bytes {float(9 * 4 * 8 * 4)}" in metrics  # 9 rows of 4 layers x 8


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--ple-residency", "offload"], "--ple-residency"),
        (["--ple-residency", "cached"], "--ple-cache-slots"),
        (["--ple-residency", "cached", "--ple-cache-slots", "1"], "--ple-cache-slots"),
        (["--ple-file", "/nonexistent/ple.safetensors"], "--ple-file"),
    ],
)
def test_serve_refuses_bad_ple_flags_in_one_line(args, flag):
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output and len(result.output.strip().splitlines()) == 1
