"""`trtedge serve --config FILE` / $TRTEDGE_CONFIG: precedence flag > env > file > default; unknown keys
and mistyped values name the key and the line; --print-config shows the effective settings."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from trtedge.cli import app
from trtedge.commands import config_file
from trtedge.commands.serve import serve

runner = CliRunner()


def _print_config(*args, env=None):
    result = runner.invoke(app, ["serve", "--print-config", *args], env=env, terminal_width=200)
    return result.exit_code, result.output


def _settings(output):
    out = {}
    for line in output.splitlines():
        if line and not line.startswith("#"):
            key, rest = line.split(" = ", 1)
            value, source = rest.split("  # ", 1)
            out[key] = (value, source)
    return out


def test_every_serve_flag_is_settable_in_the_file():
    command = typer.main.get_command(app).commands["serve"]
    params = {p.name for p in command.params} - {"config", "print_config", "help"}
    assert params <= set(config_file.settable(serve)) and "max_batch_size" in params


def test_precedence_flag_over_env_over_file_over_default(tmp_path, monkeypatch):
    monkeypatch.delenv("TRTEDGE_API_KEY", raising=False)
    path = tmp_path / "serve.toml"
    path.write_text('port = 9001\nmax-batch-size = 4\napi_key = "from-file"\nqueue_timeout = 30\n')
    code, out = _print_config("--config", str(path), "--port", "9002", env={"TRTEDGE_API_KEY": "from-env"})
    assert code == 0, out
    s = _settings(out)
    assert s["port"] == ("9002", "flag")
    assert s["api-key"] == ('"***"', "env")
    assert s["max-batch-size"] == ("4", f"file {path}")
    assert s["queue-timeout"] == ("30.0", f"file {path}")
    assert s["host"] == ('"127.0.0.1"', "default")


def test_trtedge_config_environment_variable(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('host = "0.0.0.0"\nenable-in-flight-batching = true\n')
    code, out = _print_config(env={"TRTEDGE_CONFIG": str(path)})
    assert code == 0, out
    assert _settings(out)["enable-in-flight-batching"] == ("true", f"file {path}")
    assert _settings(out)["host"][0] == '"0.0.0.0"'


def test_print_config_round_trips_as_a_config_file(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("max-input-len = 2048\n")
    code, out = _print_config("--config", str(path), "--port", "8123")
    saved = tmp_path / "saved.toml"
    saved.write_text(out)
    code, again = _print_config("--config", str(saved))
    assert code == 0, again
    assert _settings(again)["port"][0] == "8123" and _settings(again)["max-input-len"][0] == "2048"


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "port = 8000\n\nmax_batch = 4\n",
            "serve.toml:3: unknown key 'max_batch' (did you mean max-batch-size?)",
        ),
        ('host = "x"\nport = "eighty"\n', "serve.toml:2: port must be int"),
        ("enable-context-reuse = 1\n", "serve.toml:1: enable-context-reuse must be bool"),
        ("port = \n", "not valid TOML"),
        ("port = 1\nport_ = 2\n", "unknown key 'port_'"),
    ],
)
def test_bad_file_is_one_line_naming_key_and_line(tmp_path, text, message):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    code, out = _print_config("--config", str(path))
    assert code == 2
    assert message in out
    assert len(out.strip().splitlines()) == 1


def test_values_from_the_file_are_validated_like_flags(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("port = 70000\n")
    code, out = _print_config("--config", str(path))
    assert code == 2 and "--port" in out and f"(set in {path})" in out
    code, out = _print_config("--config", str(path), "--port", "70001")
    assert code == 2 and "70001" in out and "set in" not in out


def test_missing_file_and_table_speculative_config(tmp_path):
    code, out = _print_config("--config", str(tmp_path / "nope.toml"))
    assert code == 2 and "nope.toml" in out
    path = tmp_path / "serve.toml"
    path.write_text('[speculative_config]\nmethod = "ngram"\nnum_speculative_tokens = 3\n')
    code, out = _print_config("--config", str(path))
    assert code == 0, out
    assert "ngram" in _settings(out)["speculative-config"][0]


@pytest.mark.parametrize(
    "draft,verify",
    [("--draft-step", "--verify-tree-size"), ("--spec-draft-step", "--spec-verify-tokens")],
)
def test_edge_llm_spellings_of_the_speculative_geometry_are_the_same_settings(draft, verify):
    spec = ["--speculative-config", '{"method": "ngram"}']
    code, out = _print_config(*spec, draft, "2", verify, "3")
    assert code == 0, out
    settings = _settings(out)
    assert settings["max-spec-draft-tokens"] == ("2", "flag")
    assert settings["max-spec-verify-tokens"] == ("3", "flag")
    code, out = _print_config(*spec, draft, "0")
    assert code == 2 and "--max-spec-draft-tokens" in out and "num_speculative_tokens" in out
    for command in (["chat"], ["bench", "run"]):
        text = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"}).output
        assert draft in text and verify in text, command


def test_edge_llm_spellings_are_config_file_keys(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('speculative-config = \'{"method": "ngram"}\'\ndraft-step = 2\nspec_verify_tokens = 3\n')
    code, out = _print_config("--config", str(path))
    assert code == 0, out
    settings = _settings(out)
    assert settings["max-spec-draft-tokens"] == ("2", f"file {path}")
    assert settings["max-spec-verify-tokens"] == ("3", f"file {path}")
    path.write_text("max-spec-draft-tokens = 3\ndraft-step = 4\n")
    code, out = _print_config("--config", str(path))
    assert (
        code == 2
        and "serve.toml:2: 'draft-step' is set twice (as 'max-spec-draft-tokens' and 'draft-step')" in out
    )
