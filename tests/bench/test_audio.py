"""`trtedge bench --dataset audio:FILE`: transcriptions timed offline (a tiny random Qwen3-ASR
in-process, every request a new clip to the encoder) and over HTTP (streamed uploads)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trtedge.bench.workloads import audio_requests
from trtedge.cli import app

pytest.importorskip("av")
tiny_asr = pytest.importorskip("tests.tiny_asr")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_asr.make_tiny_qwen3_asr(tmp_path_factory.mktemp("asr"))


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clips") / "clip.wav"
    path.write_bytes(tiny_asr.encode_clip(tiny_asr.tone(1.3, seed=4), "wav"))
    return path


def test_offline_transcription_bench(checkpoint, clip, tmp_path, monkeypatch):
    monkeypatch.setenv("TRTEDGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "audio.json"
    args = ["bench", str(checkpoint), "--dataset", f"audio:{clip}", "--num-prompts", "3"]
    args += ["--output-len", "4", "--warmup", "1", "--max-kv-cache-capacity", "256", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    m = json.loads(out.read_text())["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (3, 0, 12)
    assert m["total_input_tokens"] >= 3 * 17  # 1.3 s of audio is 17 placeholder tokens a request


def test_a_missing_audio_file_is_named():
    result = CliRunner().invoke(app, ["bench", "--dataset", "audio:/nonexistent/clip.wav"])
    assert result.exit_code == 2 and "no such audio file" in result.output


def test_http_backend_streams_transcriptions(checkpoint, clip, tmp_path):
    from starlette.testclient import TestClient

    from trtedge import LLM
    from trtedge.bench.backends import HttpBackend
    from trtedge.bench.loadgen import run_load
    from trtedge.server.app import build_app
    from trtedge.server.config import ServeConfig

    with LLM(str(checkpoint), cache_dir=str(tmp_path / "cache"), max_kv_cache_capacity=256) as llm:
        app_ = build_app(llm, ServeConfig(override_generation_config='{"max_new_tokens": 5}'))
        backend = HttpBackend.__new__(HttpBackend)  # its client talks to the app in process
        backend.base, backend.model, backend.sampling = "http://t", llm.model_name, {"temperature": 0.0}
        with TestClient(app_, base_url="http://t") as client:
            backend.client = client
            results, _ = run_load(backend.send, audio_requests(clip, 2, 4), concurrency=1)
    assert all(r.ok for r in results), [r.error for r in results]
    for r in results:
        assert r.output_tokens == 5 and r.prompt_tokens > 17 and r.chunk_times and r.ttft <= r.e2e


def test_offline_bench_of_an_rnnt_transcriber(clip, tmp_path, monkeypatch):
    """Nemotron-3.5-ASR (a transducer) benches in-process the same way: one clip a request."""
    pytest.importorskip("transformers")
    tiny = pytest.importorskip("tests.tiny_nemotron_asr")
    checkpoint = tiny.make_tiny_nemotron_asr(tmp_path / "nemotron-asr")
    monkeypatch.setenv("TRTEDGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "audio.json"
    args = ["bench", str(checkpoint), "--dataset", f"audio:{clip}", "--num-prompts", "2"]
    args += ["--output-len", "3", "--warmup", "0", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    m = json.loads(out.read_text())["metrics"]
    assert (m["completed"], m["failed"]) == (2, 0) and m["total_output_tokens"] <= 6
    assert m["total_input_tokens"] == 2 * 18  # 1.3 s: 130 mel frames, 18 encoder frames (66, 34, 18)
