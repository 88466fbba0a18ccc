"""`trtedge serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import re
import signal
import sys

import typer

from trtedge.commands import DRAFT_STEP_FLAGS, VERIFY_TOKENS_FLAGS, exit_codes
from trtedge.commands.completion import cached_models

HELP = (
    "Serve a model over OpenAI- and Anthropic-compatible HTTP APIs (/v1/chat/completions, "
    "/v1/completions, /v1/responses, /v1/messages, /v1/audio/transcriptions, /v1/models, /health, /metrics). Ctrl-C or SIGTERM drains the requests in flight, then stops."
)


def serve(
    ctx: typer.Context,
    model: str = typer.Argument(
        None,
        autocompletion=cached_models,
        help="HF id, local HF directory or .gguf file; default: embedded SmolLM2-135M.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for all)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="Model id clients use (default: the model's name)."
    ),
    api_key: str = typer.Option(
        None, "--api-key", envvar="TRTEDGE_API_KEY", help="Require this key on /v1/* (also $TRTEDGE_API_KEY)."
    ),
    api_key_file: str = typer.Option(
        None,
        "--api-key-file",
        help='JSON {"tenant": "key", ...}: keys accepted on /v1/*; each tenant\'s cached prefixes are its own.',
    ),
    reasoning_parser: str = typer.Option(
        "auto",
        "--reasoning-parser",
        help="auto|none|qwen3|deepseek_r1|nemotron|openai: split <think> reasoning into reasoning_content "
        "when a request enables thinking.",
    ),
    tool_call_parser: str = typer.Option(
        "auto",
        "--tool-call-parser",
        help="auto|hermes|qwen3_xml|llama3_json|mistral|nemotron|generic|openai: how tool calls are read "
        "from the output (auto: from the chat template).",
    ),
    enable_auto_tool_choice: bool = typer.Option(
        False,
        "--enable-auto-tool-choice",
        help='Let the model choose tools (tool_choice="auto", the default when tools are sent).',
    ),
    override_generation_config: str = typer.Option(
        None,
        "--override-generation-config",
        help='JSON sampling defaults for requests that omit them, e.g. \'{"temperature": 0, '
        '"max_new_tokens": 256}\' (keys: temperature, top_p, top_k, min_p, repetition_penalty, '
        "max_new_tokens: the default max_tokens).",
    ),
    max_queued_requests: int = typer.Option(
        16, "--max-queued-requests", help="Requests that may wait beyond those generating; more get 429."
    ),
    queue_timeout: float = typer.Option(
        600.0, "--queue-timeout", help="Seconds a request may wait in the queue before a 429."
    ),
    allowed_local_media_path: str = typer.Option(
        None, "--allowed-local-media-path", help="Directory that image and video file paths may be read from."
    ),
    allow_remote_media: bool = typer.Option(
        False, "--allow-remote-media", help="Fetch http(s) image and video URLs (refused with 403 otherwise)."
    ),
    max_media_bytes: int = typer.Option(
        20 * 2**20,
        "--max-media-bytes",
        help="Largest image or video (bytes) a request may send or name; 413 past it.",
    ),
    media_fetch_timeout: float = typer.Option(
        10.0, "--media-fetch-timeout", help="Seconds to fetch one remote image or video."
    ),
    max_video_frames: int = typer.Option(
        32,
        "--max-video-frames",
        help="Most frames sampled from one video (fewer are spread over its length).",
    ),
    max_image_tokens: int = typer.Option(
        None,
        "--max-image-tokens",
        help="Most image tokens (all images and videos) in one request; 400 past it.",
    ),
    max_image_tokens_per_image: int = typer.Option(
        None,
        "--max-image-tokens-per-image",
        help="Most image tokens one image or video may take; 400 past it.",
    ),
    max_audio_bytes: int = typer.Option(
        25 * 2**20,
        "--max-audio-bytes",
        help="Largest audio file (bytes) a transcription upload or an audio part may carry; 413 past it.",
    ),
    max_audio_seconds: float = typer.Option(
        600.0,
        "--max-audio-seconds",
        help="Longest audio clip (seconds) a request may send; 400 past it, checked before decoding.",
    ),
    enable_profiling: bool = typer.Option(
        False,
        "--enable-profiling",
        help="Aggregate engine profiling (prefill / decode counts and per-stage times, CUDA events on a GPU) "
        "into /metrics.",
    ),
    log_level: str = typer.Option("info", "--log-level", help="critical|error|warning|info|debug|trace."),
    cache_dir: str = typer.Option(
        None,
        "--cache-dir",
        envvar="TRTEDGE_CACHE_DIR",
        help="Cache directory (default $TRTEDGE_CACHE_DIR or ~/.cache/trtedge).",
    ),
    engine_cache_max_size_gb: float = typer.Option(
        None, "--engine-cache-max-size-gb", help="Evict least-recently-used bundles past this many GiB (50)."
    ),
    clear_engine_cache: bool = typer.Option(
        False, "--clear-engine-cache", help="Clear compiled bundles before loading."
    ),
    max_input_len: int = typer.Option(4096, "--max-input-len", help="Longest prompt in tokens."),
    max_batch_size: int = typer.Option(1, "--max-batch-size", help="Most requests generating together."),
    max_kv_cache_capacity: int = typer.Option(
        8192, "--max-kv-cache-capacity", help="Prompt + output tokens per request."
    ),
    enable_in_flight_batching: bool = typer.Option(
        False, "--enable-in-flight-batching", help="New requests join the running batch at the next step."
    ),
    min_request_priority: int = typer.Option(
        None, "--min-request-priority", help="Refuse requests whose priority is below this."
    ),
    enable_context_reuse: bool = typer.Option(
        False, "--enable-context-reuse", help="Reuse the KV cache of shared prompt prefixes."
    ),
    context_cache_max_records: int = typer.Option(
        1024, "--context-cache-max-records", help="Most cached prefix blocks kept for reuse."
    ),
    context_cache_recurrent_snapshot_pool_bytes: int = typer.Option(
        None,
        "--context-cache-recurrent-snapshot-pool-bytes",
        help="Hybrid models (Qwen3.5): bytes of recurrent-state snapshots kept for reuse (default: 4 x --max-batch-size snapshots).",
    ),
    context_cache_partial_kv_snapshot_pool_bytes: int = typer.Option(
        0,
        "--context-cache-partial-kv-snapshot-pool-bytes",
        help="Bytes of snapshots of a prefix's last, partly filled KV block, so that a prefix reuses its "
        "partial block too (0: full blocks only).",
    ),
    mm_embedding_cache_bytes: int = typer.Option(
        512 * 2**20,
        "--mm-embedding-cache-bytes",
        help="Vision models: bytes of image/video encoder outputs kept for repeated media (0: off).",
    ),
    components: str = typer.Option(
        "all",
        "--components",
        help="all, or llm: load a vision-language or audio model text-only (and without speech output).",
    ),
    ple_residency: str = typer.Option(
        "resident",
        "--ple-residency",
        help="Gemma 3n / Gemma 4: resident (the per-layer embedding table on the device) or cached "
        "(on the host, a pool of --ple-cache-slots rows on the device).",
    ),
    ple_cache_slots: int = typer.Option(
        None,
        "--ple-cache-slots",
        help="--ple-residency cached: rows in the device pool (>= 2; slot 0 is padding).",
    ),
    ple_file: str = typer.Option(
        None,
        "--ple-file",
        help="A safetensors file holding the per-layer embedding table, read instead of the checkpoint's.",
    ),
    speculative_config: str = typer.Option(
        None,
        "--speculative-config",
        help='JSON {"method": "ngram|draft_model|eagle3|mtp", "model": ..., "num_speculative_tokens": k, '
        '"draft_top_k": t, "verify_tokens": v}.',
    ),
    draft_top_k: int = typer.Option(
        None, "--draft-top-k", help="Children per draft-tree level (eagle3); overrides draft_top_k."
    ),
    max_spec_draft_tokens: int = typer.Option(
        None, *DRAFT_STEP_FLAGS, help="Draft depth per step; overrides num_speculative_tokens."
    ),
    max_spec_verify_tokens: int = typer.Option(
        None, *VERIFY_TOKENS_FLAGS, help="Most draft tokens verified per step; overrides verify_tokens."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto|float32|bfloat16|float16."),
    device: str = typer.Option("auto", "--device", help="auto|cpu|cuda."),
    weights: str = typer.Option(
        "auto",
        "--weights",
        help="auto|float|bf16|fp32|int8|int4|fp8 (auto: a GGUF or pre-quantized checkpoint keeps its class; fp8: CUDA only).",
    ),
    load_format: str = typer.Option(
        "auto",
        "--load-format",
        help="auto|dummy. dummy: random weights from config.json alone, to measure a model's shape.",
    ),
    tensor_parallel_size: int = typer.Option(
        1,
        "--tensor-parallel-size",
        help="Split the model over N GPUs (CPU: N processes); N must divide the attention and KV heads.",
    ),
    distributed_init_method: str = typer.Option(
        None,
        "--distributed-init-method",
        help="torch.distributed rendezvous URL (env:// under torchrun, tcp://HOST:PORT); default: local.",
    ),
    config: str = typer.Option(
        None,
        "--config",
        envvar="TRTEDGE_CONFIG",
        help="TOML file of these flags (also $TRTEDGE_CONFIG); a flag or its env variable wins over it.",
    ),
    print_config: bool = typer.Option(
        False, "--print-config", help="Print the effective configuration as TOML, with sources, and exit."
    ),
) -> None:
    from trtedge.commands import config_file

    values = {k: v for k, v in locals().items() if k not in ("ctx", "config", "print_config")}
    types = {k: t for k, t in config_file.settable(serve).items() if k not in ("config", "print_config")}
    try:
        settings = config_file.resolve(
            ctx, values, config, types, json_keys=("speculative_config",), aliases=config_file.aliases(serve)
        )
    except config_file.ConfigFileError as e:
        _fail(str(e))
    _serve(print_config=print_config, settings=settings)


def _serve(print_config: bool, settings: dict) -> None:
    from trtedge.config import ConfigError, ContextCacheConfig, LaunchConfig, speculative_from_flags
    from trtedge.server.config import ServeConfig, ServerConfigError

    v = {name: s.value for name, s in settings.items()}
    model = v["model"]
    launch_keys = ("cache_dir", "max_input_len", "max_kv_cache_capacity", "max_batch_size")
    launch_keys += ("enable_in_flight_batching", "dtype", "device", "weights", "min_request_priority")
    launch_keys += ("load_format", "tensor_parallel_size", "distributed_init_method")
    launch_keys += ("mm_embedding_cache_bytes", "components")
    launch_kwargs = {"model": model, **{k: v[k] for k in launch_keys}}
    serve_keys = ("host", "port", "served_model_name", "api_key", "api_key_file", "reasoning_parser")
    serve_keys += ("tool_call_parser", "override_generation_config")
    serve_keys += ("enable_auto_tool_choice", "max_queued_requests", "queue_timeout")
    serve_keys += ("allowed_local_media_path", "allow_remote_media", "max_media_bytes", "media_fetch_timeout")
    serve_keys += ("max_video_frames", "max_image_tokens", "max_image_tokens_per_image")
    serve_keys += ("max_audio_bytes", "max_audio_seconds")
    serve_keys += ("engine_cache_max_size_gb", "clear_engine_cache")
    try:
        config = ServeConfig.from_env(**{k: v[k] for k in serve_keys}, log_level=v["log_level"].lower())
        context = ContextCacheConfig(
            v["enable_context_reuse"],
            v["context_cache_max_records"],
            v["context_cache_recurrent_snapshot_pool_bytes"],
            v["context_cache_partial_kv_snapshot_pool_bytes"],
        )
        spec_keys = ("speculative_config", "draft_top_k", "max_spec_draft_tokens", "max_spec_verify_tokens")
        launch_kwargs["speculative"] = speculative_from_flags(*(v[k] for k in spec_keys))
        ple = {
            "residency": v["ple_residency"],
            "cache_slots": v["ple_cache_slots"],
            "file_path": v["ple_file"],
        }
        launch_kwargs["ple"] = LaunchConfig(**launch_kwargs, context_cache=context, ple=ple).ple
    except (ServerConfigError, ConfigError) as e:
        _fail(_with_source(str(e), settings))
    if print_config:
        from trtedge.commands.config_file import to_toml

        typer.echo(to_toml(settings, secret=("api_key",)))
        raise typer.Exit()
    logging.basicConfig(
        level=logging.DEBUG if config.log_level == "trace" else config.log_level.upper(),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from trtedge import LLM, CheckpointError
    from trtedge.server.http import bind, listen

    try:
        sockets = bind(config.host, config.port)  # before the model loads: a taken port fails at once
    except ServerConfigError as e:
        _fail(str(e))

    if not config.api_key and not config.api_keys and not is_loopback(config.host):
        typer.echo(
            f"warning: serving on {config.host} without --api-key: anyone who can reach this port can use "
            "the model; pass --api-key (or --api-key-file) or bind 127.0.0.1",
            err=True,
        )
    if model is None:
        typer.echo("Using the embedded default model SmolLM2-135M-Instruct (pass MODEL to choose another).")
    del launch_kwargs["model"]
    llm_kwargs = {**launch_kwargs, "context_cache_config": context}
    llm_kwargs["speculative_config"] = llm_kwargs.pop("speculative")
    llm_kwargs["ple_config"] = llm_kwargs.pop("ple")
    accepted = inspect.signature(LLM).parameters
    for name in ("engine_cache_max_size_gb", "clear_engine_cache"):
        value = getattr(config, name)
        if name in accepted and value not in (None, False):
            llm_kwargs[name] = value
        elif value not in (None, False):
            typer.echo(f"note: --{name.replace('_', '-')} is not used by this version's runtime", err=True)
    try:
        llm = LLM(model, **llm_kwargs)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    llm.set_profiling_enabled(v["enable_profiling"])
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal: by then the requests are done, so
    # take it as "stopped" and release the engine instead of dying mid-cleanup.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        listen(sockets, config.host, config.port)
        forced = asyncio.run(_run(llm, config, sockets))
    except ServerConfigError as e:
        _fail(str(e))
    finally:
        llm.close()
    if forced:
        typer.echo(
            "trtedge serve: stopped at once (second Ctrl-C); requests in flight got 503; engine released"
        )
        raise typer.Exit(exit_codes.INTERRUPTED)
    typer.echo("trtedge serve: stopped; engine released")


async def _run(llm, config, sockets) -> bool:
    """Serve until stopped; True when a second Ctrl-C cut the drain short."""
    import uvicorn

    from trtedge.server.app import build_app
    from trtedge.server.config import KEEP_ALIVE_TIMEOUT
    from trtedge.server.http import DrainingServer, GuardedH11Protocol

    app = build_app(llm, config)
    admission = app.state.admission

    def drain() -> None:
        admission.draining = True
        typer.echo(
            f"trtedge serve: shutting down; draining {admission.num_active} active and "
            f"{admission.num_waiting} queued request(s) (Ctrl-C again to stop at once)"
        )
        sys.stdout.flush()

    server = DrainingServer(
        uvicorn.Config(
            app,
            log_level=config.log_level,
            access_log=config.log_level in ("debug", "trace"),
            lifespan="off",
            timeout_graceful_shutdown=None,
            http=GuardedH11Protocol,
            timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
        ),
        on_drain=drain,
        on_force=app.state.serving.abandon_all,
    )
    watcher = asyncio.ensure_future(_announce(server, app, llm, config))
    try:
        await server.serve(sockets=sockets)
    finally:
        watcher.cancel()
    return server.forced


async def _announce(server, app, llm, config) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    port = config.port
    for s in server.servers:
        for sock in s.sockets:
            port = sock.getsockname()[1]
    stats = llm.stats()
    tokens = stats["kv_blocks_total"] * stats["kv_block_size"]
    where = llm.describe().source
    host = f"[{config.host}]" if ":" in config.host else config.host
    lines = [
        f"model   {app.state.serving.model_name}",
        f"from    {where}",
        f"kv pool {stats['kv_blocks_total']} blocks x {stats['kv_block_size']} tokens = {tokens} tokens "
        f"({stats['kv_cache_bytes'] / 2**20:.1f} MiB)",
        f"serving http://{host}:{port}/v1 (health: http://{host}:{port}/health)",
    ]
    typer.echo("\n".join(lines))
    sys.stdout.flush()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _with_source(message: str, settings: dict) -> str:
    """Say which file a bad value came from when the flag it names was set there."""
    match = re.search(r"--([a-z0-9-]+)", message)
    setting = settings.get(match.group(1).replace("-", "_")) if match else None
    if setting is not None and setting.source.startswith("file "):
        return f"{message} (set in {setting.source.removeprefix('file ')})"
    return message


def _fail(message: str) -> None:
    typer.echo(f"trtedge serve: {message}", err=True)
    raise typer.Exit(2)
