"""ServeConfig and `trtedge serve` flag validation: a bad value is one line naming the flag, exit 2."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trtedge.cli import app
from trtedge.server.config import ServeConfig, ServerConfigError

runner = CliRunner()


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"port": 70000}, "--port"),
        ({"host": ""}, "--host"),
        ({"max_queued_requests": -1}, "--max-queued-requests"),
        ({"queue_timeout": 0}, "--queue-timeout"),
        ({"log_level": "loud"}, "--log-level"),
        ({"reasoning_parser": "nope"}, "--reasoning-parser"),
        ({"tool_call_parser": "nope"}, "--tool-call-parser"),
        ({"allowed_local_media_path": "/does/not/exist"}, "--allowed-local-media-path"),
        ({"engine_cache_max_size_gb": -1.0}, "--engine-cache-max-size-gb"),
        ({"api_key": ""}, "--api-key"),
        ({"max_media_bytes": 0}, "--max-media-bytes"),
        ({"media_fetch_timeout": 0}, "--media-fetch-timeout"),
        ({"max_video_frames": 0}, "--max-video-frames"),
        ({"max_image_tokens": -1}, "--max-image-tokens"),
        ({"max_image_tokens_per_image": 0}, "--max-image-tokens-per-image"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ServerConfigError, match=flag):
        ServeConfig(**kwargs)


def test_good_values_are_kept_and_frozen(tmp_path):
    config = ServeConfig(
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        allowed_local_media_path=str(tmp_path),
    )
    assert config.enable_auto_tool_choice
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("TRTEDGE_API_KEY", "sekret")
    assert ServeConfig.from_env().api_key == "sekret"
    assert ServeConfig.from_env(api_key="given").api_key == "given"


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--port", "99999"], "--port"),
        (["--queue-timeout", "-5"], "--queue-timeout"),
        (["--max-image-tokens-per-image", "0"], "--max-image-tokens-per-image"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
        (["--max-input-len", "9000"], "--max-input-len"),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--log-level", "shout"], "--log-level"),
        (["--context-cache-max-records", "-1"], "--context-cache-max-records"),
        (["--speculative-config", '{"method": "ngram", "model": "m"}'], "--speculative-config model"),
        (["--speculative-config", '{"method": "mtp"}', "--draft-top-k", "2"], "--draft-top-k"),
        (["--speculative-config", "{bad json"], "--speculative-config"),
        (["--speculative-config", '{"method": "eagle3"}'], "needs model"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "num_speculative_tokens",
        ),
        (["--speculative-config", '{"method": "ngram", "k": 1}'], "unknown key"),
        (
            ["--speculative-config", '{"method": "ngram"}', "--max-spec-draft-tokens", "0"],
            "--max-spec-draft-tokens",
        ),
        (["--draft-top-k", "2"], "needs --speculative-config"),
        (
            ["--speculative-config", '{"method": "ngram"}', "--spec-proposal-tokens", "0"],
            "--max-spec-draft-tokens",
        ),
        (
            ["--speculative-config", '{"method": "dspark", "model": "m"}'],
            "method dspark is not available in trtedge yet; available: draft_model, eagle3, ngram, mtp, dflash",
        ),
        (["--speculative-config", '{"method": "jetspec"}'], "method jetspec needs model"),
        (["--reasoning-parser", "granite"], "--reasoning-parser"),
        (["--tool-call-parser", "pythonic"], "--tool-call-parser"),
    ],
)
def test_cli_bad_flag_is_one_line_exit_2(args, flag):
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_help_lists_every_flag():
    result = runner.invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--reasoning-parser",
        "--tool-call-parser",
        "--enable-auto-tool-choice",
        "--max-queued-requests",
        "--queue-timeout",
        "--allowed-local-media-path",
        "--allow-remote-media",
        "--max-media-bytes",
        "--media-fetch-timeout",
        "--max-video-frames",
        "--max-image-tokens",
        "--max-image-tokens-per-image",
        "--log-level",
        "--cache-dir",
        "--engine-cache-max-size-gb",
        "--clear-engine-cache",
        "--max-input-len",
        "--max-batch-size",
        "--max-kv-cache-capacity",
        "--enable-in-flight-batching",
        "--min-request-priority",
        "--enable-context-reuse",
        "--context-cache-max-records",
        "--speculative-config",
        "--draft-top-k",
        "--max-spec-draft-tokens",
        "--max-spec-verify-tokens",
    ):
        assert flag in result.output, flag


def test_speculative_flags_override_the_json_keys():
    """--draft-top-k, --max-spec-draft-tokens (--spec-draft-step, --spec-proposal-tokens, --draft-step)
    and --max-spec-verify-tokens (--spec-verify-tokens, --verify-tree-size) set draft_top_k,
    num_speculative_tokens and verify_tokens; a tree left without verify_tokens gets its default."""
    from trtedge.config import speculative_from_flags

    head = '{"method": "eagle3", "model": "head", "num_speculative_tokens": 4}'
    config = speculative_from_flags(head, draft_top_k=3, max_spec_draft_tokens=5, max_spec_verify_tokens=7)
    assert (config.draft_top_k, config.num_speculative_tokens, config.verify_tokens) == (3, 5, 7)
    assert speculative_from_flags(head, draft_top_k=3).verify_tokens == 60  # the reference's tree size
    assert speculative_from_flags(head, max_spec_draft_tokens=6).verify_tokens == 6  # a chain: its depth
    assert speculative_from_flags(None) is None
