"""`trtedge serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import signal
import sys

import typer

from trtedge.commands import exit_codes
from trtedge.commands.completion import cached_models
from trtedge.commands.launch_options import CACHE, CONTEXT_CACHE, PLE, PRECISION, SPECULATIVE, launch_options

SERVE_LAUNCH_FLAGS = (
    *CACHE,
    "max_input_len",
    "max_batch_size",
    "max_kv_cache_capacity",
    "enable_in_flight_batching",
    "min_request_priority",
    *CONTEXT_CACHE,
    "mm_embedding_cache_bytes",
    *PLE,
    *SPECULATIVE,
    *PRECISION,
    "load_format",
    "tensor_parallel_size",
    "distributed_init_method",
)

HELP = (
    "Serve a model over OpenAI- and Anthropic-compatible HTTP APIs (/v1/chat/completions, "
    "/v1/completions, /v1/responses, /v1/messages, /v1/audio/transcriptions, /v1/models, /health, /metrics). Ctrl-C or SIGTERM drains the requests in flight, then stops."
)


@launch_options(*SERVE_LAUNCH_FLAGS)
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
    components: str = typer.Option(
        "all",
        "--components",
        help="all, or llm: load a vision-language or audio model text-only (and without speech output).",
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
    launch: dict | None = None,
) -> None:
    from trtedge.commands import config_file

    own = {k: v for k, v in locals().items() if k not in ("ctx", "config", "print_config", "launch")}
    values = {**own, **launch}
    types = {k: t for k, t in config_file.settable(serve).items() if k not in ("config", "print_config")}
    try:
        settings = config_file.resolve(
            ctx, values, config, types, json_keys=("speculative_config",), aliases=config_file.aliases(serve)
        )
    except config_file.ConfigFileError as e:
        _fail(str(e))
    _serve(print_config=print_config, settings=settings)


def _serve(print_config: bool, settings: dict) -> None:
    from trtedge.commands.launch_options import launch_config, llm_options
    from trtedge.config import ConfigError
    from trtedge.server.config import ServeConfig, ServerConfigError

    v = {name: s.value for name, s in settings.items()}
    model = v["model"]
    serve_keys = ("host", "port", "served_model_name", "api_key", "api_key_file", "reasoning_parser")
    serve_keys += ("tool_call_parser", "override_generation_config")
    serve_keys += ("enable_auto_tool_choice", "max_queued_requests", "queue_timeout")
    serve_keys += ("allowed_local_media_path", "allow_remote_media", "max_media_bytes", "media_fetch_timeout")
    serve_keys += ("max_video_frames", "max_image_tokens", "max_image_tokens_per_image")
    serve_keys += ("max_audio_bytes", "max_audio_seconds")
    serve_keys += ("engine_cache_max_size_gb", "clear_engine_cache")
    try:
        config = ServeConfig.from_env(**{k: v[k] for k in serve_keys}, log_level=v["log_level"].lower())
        options = llm_options({k: v[k] for k in SERVE_LAUNCH_FLAGS})
        options["components"] = v["components"]
        launch_config(model, options)  # refused before the port is bound and the model loads
    except (ServerConfigError, ConfigError, ValueError) as e:
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
    try:
        llm = LLM(model, **options)
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
