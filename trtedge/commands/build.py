"""`trtedge build MODEL`: compile a checkpoint into a cached runtime bundle (or find it built)."""

from __future__ import annotations

import json
import logging
import sys
import time

import typer

from trtedge.commands.completion import cached_models
from trtedge.commands.exit_codes import FAILED, USAGE
from trtedge.commands.launch_options import launch_options

HELP = (
    "Compile a checkpoint into a cached runtime bundle: convert weights (GGUF dequantization, dtype "
    "casts), copy tokenizer and template, write manifest.json, publish atomically. A bundle already "
    "built for the same checkpoint and profile is reused."
)


@launch_options(
    "cache_dir",
    "max_input_len",
    "max_kv_cache_capacity",
    "max_batch_size",
    "dtype",
    "weights",
    "speculative_config",
    "tensor_parallel_size",
    "engine_cache_max_size_gb",
    changed={
        "speculative_config": (
            None,
            'JSON {"method": ..., "model": ...}: method draft_model pairs the draft checkpoint with the '
            "bundle (cache key of both); other methods build the plain bundle.",
        ),
    },
)
def build(
    model: str = typer.Argument(
        None,
        autocompletion=cached_models,
        help="HF id, local HF directory or .gguf file; default: embedded SmolLM2-135M.",
    ),
    components: str = typer.Option(
        "all",
        "--components",
        help="all, or a comma list of: llm, draft, vision (audio: the same, for an audio model's encoder), "
        "talker,code_predictor,code2wav (speech output, together).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log details to stderr."),
    launch: dict | None = None,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr
    )
    from trtedge import CheckpointError
    from trtedge.config import DEFAULT_MAX_INPUT_LEN
    from trtedge.runtime.artifacts.bundle import BuildProfile, BundleError, check_max_size_gb, prepare_bundle

    capacity, max_input_len = launch["max_kv_cache_capacity"], launch["max_input_len"]
    if max_input_len is None:  # as a launch with the same flags resolves it
        max_input_len = min(DEFAULT_MAX_INPUT_LEN, max(capacity, 1))
    try:
        check_max_size_gb(launch["engine_cache_max_size_gb"])
        profile = BuildProfile.create(
            components=components,
            speculative=launch["speculative_config"],
            max_input_len=max_input_len,
            max_kv_cache_capacity=capacity,
            max_batch_size=launch["max_batch_size"],
            dtype=launch["dtype"],
            weights=launch["weights"],
            tensor_parallel_size=launch["tensor_parallel_size"],
        )
        if max_input_len > capacity:
            raise BundleError(f"--max-input-len {max_input_len} exceeds --max-kv-cache-capacity {capacity}")
    except BundleError as e:
        _fail(str(e), USAGE)
    start = time.perf_counter()
    try:
        with _progress(quiet=as_json) as report:
            bundle = prepare_bundle(
                model,
                profile,
                cache_dir=launch["cache_dir"],
                max_size_gb=launch["engine_cache_max_size_gb"],
                progress=report,
            )
    except CheckpointError as e:  # MODEL does not exist or cannot be read: bad input, as for serve and chat
        _fail(str(e), USAGE)
    except (ValueError, OSError) as e:  # BundleError, GGUFError; a bundle that cannot be written
        _fail(str(e), FAILED)
    bundle.release()
    if as_json:
        typer.echo(json.dumps({"key": bundle.key, "path": str(bundle.path), **bundle.manifest}, indent=2))
        return
    seconds = time.perf_counter() - start
    verb = f"built in {seconds:.1f} s" if bundle.built else "already built (reused)"
    typer.echo(f"{bundle.name}: bundle {bundle.key} {verb}\n{bundle.path}")


class _progress:
    """A rich progress bar fed by the builder's (stage, done, total) callback; silent when quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet or not sys.stderr.isatty()
        self.bar = None
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
        return self.report

    def report(self, stage: str, done: int, total: int | None) -> None:
        if self.bar is None:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(f"{stage} weights", total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fail(message: str, code: int) -> None:
    typer.echo(f"trtedge build: {message}", err=True)
    raise typer.Exit(code)
