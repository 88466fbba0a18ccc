"""`trtedge build MODEL`: compile a checkpoint into a cached runtime bundle (or find it built)."""

from __future__ import annotations

import json
import logging
import sys
import time

import typer

from trtedge.commands.completion import cached_models
from trtedge.commands.exit_codes import FAILED, USAGE

HELP = (
    "Compile a checkpoint into a cached runtime bundle: convert weights (GGUF dequantization, dtype "
    "casts), copy tokenizer and template, write manifest.json, publish atomically. A bundle already "
    "built for the same checkpoint and profile is reused."
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
    cache_dir: str = typer.Option(
        None, "--cache-dir", help="Cache directory (default $TRTEDGE_CACHE_DIR or ~/.cache/trtedge)."
    ),
    max_input_len: int = typer.Option(4096, "--max-input-len", help="Longest prompt in tokens."),
    max_kv_cache_capacity: int = typer.Option(
        8192, "--max-kv-cache-capacity", help="Prompt + output tokens per request."
    ),
    max_batch_size: int = typer.Option(1, "--max-batch-size", help="Most requests in one batch."),
    dtype: str = typer.Option("auto", "--dtype", help="auto|float32|bfloat16|float16."),
    weights: str = typer.Option(
        "auto",
        "--weights",
        help="Stored weights: auto|float|bf16|fp32|int8|int4|fp8 (auto: a GGUF or pre-quantized checkpoint keeps its class; fp8: CUDA only).",
    ),
    speculative_config: str = typer.Option(
        None,
        "--speculative-config",
        help='JSON {"method": ..., "model": ...}: method draft_model pairs the draft checkpoint with '
        "the bundle (cache key of both); other methods build the plain bundle.",
    ),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", help="The launch's --tensor-parallel-size (part of the bundle key)."
    ),
    max_size_gb: float = typer.Option(
        50.0, "--engine-cache-max-size-gb", help="Evict least-recently-used bundles past this many GiB."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log details to stderr."),
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr
    )
    from trtedge import CheckpointError
    from trtedge.runtime.artifacts.bundle import BuildProfile, BundleError, check_max_size_gb, prepare_bundle

    try:
        check_max_size_gb(max_size_gb)
        profile = BuildProfile.create(
            components=components,
            speculative=speculative_config,
            max_input_len=max_input_len,
            max_kv_cache_capacity=max_kv_cache_capacity,
            max_batch_size=max_batch_size,
            dtype=dtype,
            weights=weights,
            tensor_parallel_size=tensor_parallel_size,
        )
        if max_input_len > max_kv_cache_capacity:
            raise BundleError(
                f"--max-input-len {max_input_len} exceeds --max-kv-cache-capacity {max_kv_cache_capacity}"
            )
    except BundleError as e:
        _fail(str(e), USAGE)
    start = time.perf_counter()
    try:
        with _progress(quiet=as_json) as report:
            bundle = prepare_bundle(
                model, profile, cache_dir=cache_dir, max_size_gb=max_size_gb, progress=report
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
