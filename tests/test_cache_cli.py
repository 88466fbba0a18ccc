"""`trtedge build` and `trtedge cache ls|prune|clear|path`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tiny import make_tiny_checkpoint
from trtedge.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    return tmp_path / "cache"


def _build(tiny: Path, cache_dir: Path, *extra: str):
    return runner.invoke(app, ["build", str(tiny), "--cache-dir", str(cache_dir), *extra])


def test_build_json_prints_manifest_and_second_build_reuses(tiny, cache_dir):
    result = _build(tiny, cache_dir, "--json", "--max-batch-size", "2")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["profile"]["max_batch_size"] == 2 and manifest["components"]["llm"]["config"]
    assert Path(manifest["path"], "manifest.json").is_file()
    again = _build(tiny, cache_dir, "--max-batch-size", "2")
    assert again.exit_code == 0 and "reused" in again.stdout and manifest["key"] in again.stdout


def test_build_bad_flags_exit_non_zero_naming_the_flag(tiny, cache_dir):
    result = _build(tiny, cache_dir, "--components", "vision")
    assert result.exit_code == 2 and "--components" in result.output
    result = _build(tiny, cache_dir, "--engine-cache-max-size-gb", "nan")
    assert result.exit_code == 2 and "--engine-cache-max-size-gb" in result.output
    result = _build(tiny, cache_dir, "--speculative-config", '{"method": "draft_model"}')
    assert result.exit_code == 2 and "needs model" in result.output
    result = runner.invoke(app, ["build", str(cache_dir / "missing"), "--cache-dir", str(cache_dir)])
    assert result.exit_code == 2 and "no such file" in result.output  # a bad MODEL is bad input


def test_build_with_draft_component(tiny, cache_dir, tmp_path):
    draft = make_tiny_checkpoint(tmp_path / "draft", "qwen2", seed=1)
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    result = _build(tiny, cache_dir, "--json", "--speculative-config", spec)
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert set(manifest["components"]) == {"llm", "draft"}
    assert Path(manifest["path"], "draft", "tokenizer.json").is_file()


def test_ls_path_and_clear(tiny, cache_dir):
    assert _build(tiny, cache_dir).exit_code == 0
    (cache_dir / "checkpoints").mkdir()
    (cache_dir / "checkpoints" / "keep").write_text("x")
    listed = runner.invoke(app, ["cache", "ls", "--json", "--cache-dir", str(cache_dir)])
    assert listed.exit_code == 0
    (entry,) = json.loads(listed.stdout)
    assert entry["model"] == str(tiny) and entry["size_bytes"] > 0 and entry["in_use"] is False
    table = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache_dir)])
    assert table.exit_code == 0 and entry["key"][:8] in table.stdout
    path = runner.invoke(app, ["cache", "path", "--cache-dir", str(cache_dir)])
    assert path.stdout.strip() == str(cache_dir)

    refused = runner.invoke(app, ["cache", "clear", "--cache-dir", str(cache_dir)], input="")
    assert refused.exit_code == 2 and "--yes" in refused.output
    cleared = runner.invoke(app, ["cache", "clear", "--yes", "--cache-dir", str(cache_dir)])
    assert cleared.exit_code == 0 and cleared.output == ""
    assert not list((cache_dir / "bundles").iterdir()) and (cache_dir / "checkpoints" / "keep").is_file()
    runner.invoke(app, ["cache", "clear", "--yes", "--checkpoints", "--cache-dir", str(cache_dir)])
    assert not (cache_dir / "checkpoints").exists()


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_prune_refuses_bad_cap_with_one_line(cache_dir, bad):
    result = runner.invoke(app, ["cache", "prune", "--max-size-gb", bad, "--cache-dir", str(cache_dir)])
    assert result.exit_code == 2
    assert "--max-size-gb" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["prune"], ["clear", "--yes"]])
def test_a_cache_dir_that_is_missing_or_a_file_fails_naming_it(tmp_path, command):
    missing, regular = tmp_path / "typo", tmp_path / "file"
    regular.write_text("x")
    for where, why in ((missing, "no such directory"), (regular, "not a directory")):
        result = runner.invoke(app, ["cache", *command, "--cache-dir", str(where)])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == f"trtedge cache: --cache-dir {where}: {why}"
    assert not missing.exists() and regular.read_text() == "x"


def test_chat_refuses_bad_engine_cache_cap():
    result = runner.invoke(app, ["chat", "--prompt", "hi", "--engine-cache-max-size-gb", "0"])
    assert result.exit_code == 2 and "--engine-cache-max-size-gb" in result.output


def test_prune_from_cron_is_quiet_and_writes_nothing_outside_the_cache(tiny, cache_dir, tmp_path):
    for batch in ("1", "2"):
        assert _build(tiny, cache_dir, "--max-batch-size", batch).exit_code == 0
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TRTEDGE_CACHE_DIR": str(cache_dir)}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "trtedge.cli", "cache", "prune"]

    def cron(*extra):
        return subprocess.run(
            command + list(extra),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    quiet = cron()
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    evict = cron("--max-size-gb", "0.000000001")
    assert (evict.returncode, evict.stdout, evict.stderr) == (0, "", "")
    assert not list((cache_dir / "bundles").iterdir())
    assert not list(home.rglob("*"))
    verbose = cron("-v")
    assert verbose.returncode == 0 and "evicted 0 bundle(s)" in verbose.stdout
    failed = cron("--max-size-gb", "0")
    assert failed.returncode != 0 and failed.stdout == "" and len(failed.stderr.strip().splitlines()) == 1
