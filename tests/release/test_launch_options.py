"""The launch flags are declared once (trtedge/commands/launch_options.py) and shared by serve, chat,
build and bench: their defaults are LaunchConfig's, their help is the same text in every command, and
their choice lists are the runtime's one list."""

from __future__ import annotations

import dataclasses

import typer.main

from trtedge.cli import app
from trtedge.commands.launch_options import FLAGS, llm_options
from trtedge.config import ContextCacheConfig, LaunchConfig, PleRuntimeConfig
from trtedge.runtime.artifacts import choices

COMMANDS = {"serve": ("serve",), "chat": ("chat",), "build": ("build",), "bench": ("bench", "run")}


def _command(path):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def test_the_flag_defaults_are_launch_config_s():
    launch = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    context, ple = ContextCacheConfig(), PleRuntimeConfig()
    also = {
        "enable_context_reuse": context.enabled,
        "context_cache_max_records": context.max_records,
        "context_cache_recurrent_snapshot_pool_bytes": context.recurrent_snapshot_pool_bytes,
        "context_cache_partial_kv_snapshot_pool_bytes": context.partial_kv_snapshot_pool_bytes,
        "ple_residency": ple.residency,
        "ple_cache_slots": ple.cache_slots,
        "ple_file": ple.file_path,
    }
    for name, flag in FLAGS.items():
        if name in launch or name in also:
            assert flag.default == {**launch, **also}[name], name


def test_every_command_shows_the_one_help_of_a_shared_flag():
    seen = 0
    for name, path in COMMANDS.items():
        for param in _command(path).params:
            flag = FLAGS.get(param.name)
            if flag is None or param.help.startswith("Offline: ") and name == "bench":
                continue
            if (name, param.name) in {("build", "speculative_config")}:
                continue  # a build pairs a draft: its help says so
            assert param.help == flag.help, (name, param.name)
            seen += 1
    assert seen > 40


def test_the_choice_lists_are_the_runtime_s_one_list():
    from trtedge import config
    from trtedge.runtime.artifacts.bundle import BuildProfile

    assert config.WEIGHTS is choices.WEIGHTS and config.DTYPES is choices.DTYPES
    assert "|".join(choices.WEIGHTS) in FLAGS["weights"].help
    for weights in choices.WEIGHTS:
        BuildProfile(weights=weights)  # every listed value builds


def test_llm_options_group_the_flags_as_llm_takes_them():
    options = llm_options(
        {
            "dtype": "float32",
            "enable_context_reuse": True,
            "max_spec_draft_tokens": None,
            "ple_residency": "cached",
        }
    )
    assert options["dtype"] == "float32" and options["context_cache_config"].enabled is True
    assert options["speculative_config"] is None and options["ple_config"]["residency"] == "cached"
    assert "enable_context_reuse" not in options
