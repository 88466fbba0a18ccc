"""`trtedge bench [MODEL]` and `trtedge bench compare A.json B.json`."""

from __future__ import annotations

import json
import math
import os
import sys

import typer
from typer.core import TyperGroup

from trtedge.commands.exit_codes import FAILED, INTERRUPTED, USAGE
from trtedge.commands.launch_options import PRECISION, SPECULATIVE, launch_options, llm_options

HELP = (
    "Benchmark a model offline (in-process) or a running OpenAI-compatible server (--url): "
    "TTFT/TPOT/ITL/E2E percentiles, throughput, achieved bandwidth. `trtedge bench compare A.json B.json` "
    "prints the ratio of every figure."
)


class _RunByDefault(TyperGroup):
    """`trtedge bench MODEL --flags` means `trtedge bench run MODEL --flags`."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)

    def format_help(self, ctx, formatter):
        """`trtedge bench --help` shows the commands, then every flag of the default `run`."""
        super().format_help(ctx, formatter)
        run = self.commands["run"]
        run.format_help(run.make_context("run", [], parent=ctx, resilient_parsing=True), formatter)


app = typer.Typer(cls=_RunByDefault, no_args_is_help=False)


@app.command("run", help="Run a benchmark (the default: `trtedge bench MODEL ...` runs this).")
@launch_options(
    "max_batch_size",
    "max_kv_cache_capacity",
    *PRECISION,
    "load_format",
    *SPECULATIVE,
    "tensor_parallel_size",
    prefix="Offline: ",
    changed={
        "max_batch_size": (None, "Engine batch (default: the highest concurrency, or 8)."),
        "max_kv_cache_capacity": (None, "Tokens per request (default: fits the workload)."),
    },
)
def run(
    model: str = typer.Argument(
        None, help="HF id, local HF directory or .gguf file; default: embedded SmolLM2-135M (offline)."
    ),
    url: str = typer.Option(None, "--url", help="Benchmark this OpenAI-compatible server instead."),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="Model id sent with --url (default: the server's first model)."
    ),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer key for --url."),
    dataset: str = typer.Option(
        "random",
        "--dataset",
        help="random | fixed | path to a .jsonl file | audio:FILE (transcriptions of an audio file).",
    ),
    num_prompts: int = typer.Option(16, "--num-prompts", help="Requests to send (per sweep point)."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens (random, fixed)."),
    output_len: int = typer.Option(64, "--output-len", help="max_tokens per request."),
    range_ratio: float = typer.Option(
        0.0, "--range-ratio", help="Random lengths uniform in len*(1-r)..len*(1+r)."
    ),
    vocab_size: int = typer.Option(
        None, "--vocab-size", help="Random token ids below this (default: the tokenizer's; 32000 with --url)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the workload and the Poisson arrivals."),
    ignore_eos: bool = typer.Option(
        True, "--ignore-eos/--no-ignore-eos", help="Generate exactly max_tokens (default on)."
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling."),
    top_k: int = typer.Option(-1, "--top-k", help="Top-k sampling (-1 off)."),
    concurrency: int = typer.Option(
        None, "--concurrency", help="Most requests in flight (default 1; unbounded with --request-rate)."
    ),
    request_rate: float = typer.Option(
        None, "--request-rate", help="Poisson arrivals per second (default: all at once)."
    ),
    warmup: int = typer.Option(1, "--warmup", help="Requests sent first and not measured."),
    sweep: str = typer.Option(
        None, "--sweep", help="Several load points: concurrency=1,4,16 or request_rate=1,2."
    ),
    goodput: list[str] = typer.Option(
        None, "--goodput", help="SLOs in ms for goodput, e.g. --goodput ttft:500 --goodput tpot:50."
    ),
    peak_bandwidth_gbs: float = typer.Option(
        None, "--peak-bandwidth-gbs", help="The device's peak memory bandwidth (default: a table of GPUs)."
    ),
    json_path: str = typer.Option(None, "--json", help="Write every figure and the configuration here."),
    plot_path: str = typer.Option(None, "--plot", help="Draw latency CDFs or a sweep's curves (PNG)."),
    launch: dict | None = None,
) -> None:
    from rich.console import Console

    from trtedge.bench import report, suite
    from trtedge.bench.metrics import parse_goodput

    console = Console(stderr=True)
    if url and model:
        _fail("give MODEL (offline) or --url (a running server), not both")
    if concurrency is None and request_rate is None and not (sweep or "").startswith("request"):
        concurrency = 1  # a rate (or a sweep over rates) alone leaves the number in flight unbounded
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "ignore_eos": ignore_eos}
    try:
        config = suite.BenchConfig(
            dataset=dataset,
            num_prompts=num_prompts,
            input_len=input_len,
            output_len=output_len,
            range_ratio=range_ratio,
            seed=seed,
            concurrency=concurrency,
            request_rate=request_rate or math.inf,
            warmup=warmup,
            sweep=suite.parse_sweep(sweep),
            goodput=parse_goodput(goodput),
            sampling=sampling,
        )
        options = llm_options(launch)
    except ValueError as e:
        _fail(str(e))
    if options["speculative_config"] is not None and url:
        _fail("--speculative-config is for offline runs; give it to `trtedge serve` for --url")

    if dataset.startswith("audio:") and not os.path.isfile(dataset[6:]):
        _fail(f"--dataset: no such audio file {dataset[6:]!r}")
    if (
        dataset not in ("random", "fixed")
        and not dataset.startswith("audio:")
        and not os.path.isfile(dataset)
    ):
        _fail(f"--dataset: no such file {dataset!r} (random, fixed, a .jsonl file or audio:FILE)")
    llm = backend = None
    try:
        if url:
            from trtedge.bench.backends import HttpBackend

            backend = HttpBackend(url, served_model_name, sampling, api_key=api_key)
            env = {**suite.environment(), "url": url, "model": backend.model, "server": backend.server_info()}
            vocab = vocab_size or 32000
        else:
            llm = _load(config, model, options, console)
            from trtedge.bench.backends import OfflineBackend

            backend = OfflineBackend(llm, sampling)
            env = suite.environment(llm)
            vocab = vocab_size or llm.vocab_size
        requests = suite.make_requests(config, vocab)
        result = _run_with_progress(config, backend.send, requests, console)
        title = f"trtedge bench: {env.get('model')} ({'--url ' + url if url else 'offline'})"
        payload = {"config": {"title": title, "mode": "url" if url else "offline", **_config_dict(config)}}
        payload["environment"] = env
        payload.update(result)
        if llm is not None and not config.sweep and config.concurrency == 1:
            suite.add_bandwidth(payload["metrics"], payload["requests"], llm, peak_bandwidth_gbs)
        if llm is not None and llm.speculative_metrics() is not None:
            payload["speculative"] = llm.speculative_metrics()
    except KeyboardInterrupt:
        typer.echo("trtedge bench: interrupted", err=True)
        raise typer.Exit(INTERRUPTED) from None
    except suite.WarmupFailed as e:
        typer.echo(f"trtedge bench: the warm-up request failed, so the run stops: {e}", err=True)
        raise typer.Exit(FAILED) from None
    except (ValueError, OSError) as e:
        _fail(str(e))
    except Exception as e:  # a server that is down, a model that does not load
        _fail(f"{type(e).__name__}: {e}")
    finally:
        if llm is not None:
            llm.close()
        elif backend is not None:
            backend.close()

    out = Console()
    if config.sweep:
        out.print(report.sweep_table(result["sweep"]["points"], config.sweep[0]))
    else:
        report.print_tables(report.run_tables(payload["metrics"], title), out)
    if payload.get("speculative"):
        out.print(report.speculative_line(payload["speculative"]))
    write_outputs(payload, json_path, plot_path, console)
    runs = [p["metrics"] for p in result["sweep"]["points"]] if config.sweep else [result["metrics"]]
    if not any(m["completed"] for m in runs):
        typer.echo("trtedge bench: every request failed", err=True)
        raise typer.Exit(FAILED)


@app.command("compare", help="Print the ratio B / A of every figure of two `--json` result files.")
def compare(
    a: str = typer.Argument(..., help="Baseline result (--json of a run)."),
    b: str = typer.Argument(..., help="Result to compare with the baseline."),
) -> None:
    from trtedge.bench import report

    try:
        payload_a, payload_b = (json.loads(open(p).read()) for p in (a, b))
    except (OSError, json.JSONDecodeError) as e:
        _fail(f"cannot read a result file: {e}")
    tables = report.compare_tables(payload_a, payload_b, "A", "B")
    if not tables:
        _fail("the two files have no run in common (sweeps over different points?)")
    typer.echo(f"A = {a}\nB = {b}")
    report.print_tables(tables)


def write_outputs(payload: dict, json_path: str | None, plot_path: str | None, console) -> None:
    """--json and --plot; each says what it wrote, or why not, as plain text (never rich markup)."""
    from rich.markup import escape

    from trtedge.bench import report

    if json_path:
        report.write_json(json_path, payload)
        console.print(escape(f"wrote {json_path}"))
    if plot_path:
        why_not = report.plot(plot_path, payload)
        console.print(escape(f"--plot skipped: {why_not}" if why_not else f"wrote {plot_path}"))


def _load(config, model, options: dict, console):
    """The LLM for an offline run: the batch and the context fitted to the workload unless given."""
    from trtedge.llm import LLM

    options = dict(options)
    batch = options.pop("max_batch_size") or config.max_concurrency or 8
    capacity = options.pop("max_kv_cache_capacity")
    if capacity is None:
        ratio = 1 + config.range_ratio
        need = int(config.input_len * ratio) + int(config.output_len * ratio) + 16
        text_prompts = config.dataset not in ("random", "fixed")
        capacity = 4096 if text_prompts else max(256, -(-need // 256) * 256)
    with console.status("loading the model..."):
        return LLM(
            model,
            max_batch_size=batch,
            enable_in_flight_batching=batch > 1,
            max_kv_cache_capacity=capacity,
            max_input_len=capacity - 1,
            **options,
        )


def _run_with_progress(config, send, requests, console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trtedge.bench import suite

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console,
        transient=not console.is_terminal,
    ) as progress:

        def on_point(label: str, total: int):
            task = progress.add_task(label, total=total, failed=0)

            def on_result(result) -> None:
                failed = progress.tasks[task].fields["failed"] + (0 if result.ok else 1)
                progress.update(task, advance=1, failed=failed)

            return on_result

        if config.warmup:
            progress.console.print(f"warming up with {config.warmup} request(s)", markup=False)
        return suite.run_suite(config, send, requests, on_point)


def _config_dict(config) -> dict:
    from dataclasses import asdict

    d = asdict(config)
    d["request_rate"] = None if math.isinf(config.request_rate) else config.request_rate
    d["argv"] = sys.argv[1:]
    return d


def _fail(message: str):
    typer.echo(f"trtedge bench: {message}", err=True)
    raise typer.Exit(USAGE)
