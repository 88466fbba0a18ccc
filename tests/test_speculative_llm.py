"""Speculative decoding through the public surfaces: LLM(speculative_config=...), per-request metrics,
the paired draft bundle, /health and `trtedge bench`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.runtime.spec_helpers import repetitive_prompts
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, ConfigError, SamplingParams
from trtedge.cli import app

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("specllm")
    return make_tiny_checkpoint(root / "t", "qwen2"), make_tiny_checkpoint(root / "d", "qwen2", seed=3)


def _llm(path, **kw) -> LLM:
    return LLM(
        str(path),
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_batch_size=4,
        enable_in_flight_batching=True,
        **kw,
    )


def test_llm_speculative_config_matches_plain_and_reports_metrics(paths):
    target, draft = paths
    prompt = repetitive_prompts(1, seed=9)[0]
    with _llm(target) as plain:
        expected = plain.generate(prompt, GREEDY).token_ids
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    with _llm(target, speculative_config=spec) as llm:
        assert llm.bundle.draft is not None  # the paired bundle carries the draft
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == expected
        m = out.metrics
        assert m.spec_steps > 0 and m.spec_draft_tokens >= m.spec_accepted_tokens >= 0
        assert m.spec_mean_accepted_length >= 1.0 and m.spec_verification_time > 0
        health = llm.stats()["speculative"]
        assert health["method"] == "draft_model" and health["steps"] == m.spec_steps
        off = llm.generate(
            prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, disable_spec_decode=True)
        )
        assert off.token_ids == expected and off.metrics.spec_steps == 0


def test_llm_refuses_bad_speculative_config_naming_the_key(paths):
    target, _ = paths
    with pytest.raises(ConfigError, match="unknown key"):
        _llm(target, speculative_config={"method": "ngram", "tokens": 3})
    with pytest.raises(
        ConfigError,
        match="mtp needs the checkpoint's multi-token-prediction layers, and this qwen2 checkpoint has none",
    ):
        _llm(target, speculative_config={"method": "mtp"})
    with pytest.raises(ConfigError, match="needs model"):
        _llm(target, speculative_config='{"method": "draft_model"}')


def test_bench_offline_prints_speculative_figures(paths, tmp_path):
    target, _ = paths
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(target),
            "--num-prompts",
            "2",
            "--input-len",
            "24",
            "--output-len",
            "12",
            "--speculative-config",
            '{"method": "ngram"}',
            "--max-spec-draft-tokens",
            "3",
            "--json",
            str(out),
            "--warmup",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "speculative ngram" in result.output
    payload = json.loads(out.read_text())
    assert payload["speculative"]["num_speculative_tokens"] == 3
