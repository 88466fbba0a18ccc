"""The `trtedge` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trtedge.cli import app

runner = CliRunner()


def test_version_names_torch_and_device():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert "trtedge 0." in result.output and "torch " in result.output and "device " in result.output


@pytest.mark.parametrize("command", ["build", "serve", "chat", "cache", "bench"])
def test_every_subcommand_has_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_bench_compare_is_a_subcommand_and_bench_model_runs_by_default():
    result = runner.invoke(app, ["bench", "--help"])
    assert "compare" in result.output and "run" in result.output
    result = runner.invoke(app, ["bench", "compare", "--help"])
    assert result.exit_code == 0 and "B.json" not in result.output and "Baseline" in result.output


def test_chat_without_a_terminal_reads_stdin_and_refuses_an_empty_one():
    # Interactive mode needs a TTY (tests/chat drives it in one); otherwise stdin is the prompt.
    result = runner.invoke(app, ["chat"], input="")
    assert result.exit_code == 2
    assert "stdin is empty" in result.output and "--prompt" in result.output


def test_bad_flag_value_names_the_flag():
    result = runner.invoke(app, ["chat", "--prompt", "hi", "--max-tokens", "0"])
    assert result.exit_code == 2
    assert "--max-tokens" in result.output
    result = runner.invoke(app, ["chat", "--prompt", "hi", "--dtype", "float8"])
    assert result.exit_code == 2
    assert "--dtype" in result.output


def test_missing_model_path_exit_2(tmp_path):
    result = runner.invoke(app, ["chat", str(tmp_path / "missing"), "--prompt", "hi"])
    assert result.exit_code == 2
    assert "no such file or directory" in result.output


def test_one_shot_chat_streams_answer_to_stdout():
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtedge.cli",
            "chat",
            "--prompt",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "embedded default model" in proc.stderr
    assert "chat template" not in proc.stderr  # an instruction-tuned model: no warning


def test_chat_warns_when_the_model_has_no_chat_template_and_asks_in_raw_text(tmp_path):
    import json

    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    config = tmp_path / "tiny" / "tokenizer_config.json"
    config.write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"})
    )
    args = ["chat", str(tiny), "-p", "w5 w6", "--max-tokens", "2", "--temperature", "0"]
    result = CliRunner().invoke(app, [*args, "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 0, result.output
    assert "warning: this model has no chat template" in result.stderr
    assert "sent as raw text" in result.stderr
