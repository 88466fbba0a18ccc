"""lm-evaluation-harness (`lm_eval`, installed by scripts/install-lm-eval.sh) against `trtedge serve`
on the embedded model, with the small local tasks of tests/e2e/lm_eval_tasks: a multiple-choice task
(scored from the prompt's own token logprobs: completions echo + logprobs) and a generate_until task,
both through `local-completions` with the server's own tokenizer (/tokenizer_info, /tokenize)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_process import ServeProcess

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
MODEL = "SmolLM2-135M-Instruct"


def lm_eval_command() -> list[str]:
    if shutil.which("lm_eval") is None and not _importable("lm_eval"):
        pytest.skip("lm-evaluation-harness is not installed: run scripts/install-lm-eval.sh in the venv")
    return [sys.executable, "-m", "lm_eval"]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def run_lm_eval(url: str, tasks: str, limit: int, out: Path, tmp: Path) -> dict:
    """Run lm_eval's local-completions against ``url`` and return its results JSON."""
    command = lm_eval_command() + [
        "--model",
        "local-completions",
        "--model_args",
        f"base_url={url}/v1/completions,model={MODEL},num_concurrent=1,max_retries=1,timeout=120",
        "--tasks",
        tasks,
        "--include_path",
        str(TASKS),
        "--limit",
        str(limit),
        "--output_path",
        str(out),
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),  # the datasets cache of the local files, never the user's
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [results] = list(out.rglob("results_*.json"))
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm_eval_command()
    process = ServeProcess(tmp_path_factory, [])
    yield process
    process.stop()


def test_lm_eval_multiple_choice_and_generate_until_complete_against_serve(server, tmp_path):
    limit = 6
    results = run_lm_eval(server.url, "trtedge_mc,trtedge_gen", limit, tmp_path / "out", tmp_path)
    mc, gen = results["results"]["trtedge_mc"], results["results"]["trtedge_gen"]
    assert results["n-samples"]["trtedge_mc"]["effective"] == limit
    # every choice was scored from real logprobs: a stub (no logprobs, or all equal) scores 1/4 or fails
    assert mc["acc,none"] >= 0.5, mc
    assert (
        0.0 <= gen["exact_match,strip"] <= 1.0 and results["n-samples"]["trtedge_gen"]["effective"] == limit
    )
    health = server.health()
    assert health["engine"]["kv_blocks_free"] == health["engine"]["kv_blocks_total"]  # nothing leaked
