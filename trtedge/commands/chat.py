"""`trtedge chat [MODEL] --prompt TEXT`: stream one answer to stdout."""

from __future__ import annotations

import logging
import sys

import typer

HELP = (
    "Chat with a model. With --prompt, answer once and stream the reply to stdout "
    "(the interactive terminal chat is not available yet in this version)."
)


def chat(
    model: str = typer.Argument(
        None, help="HF id, local HF directory or .gguf file; default: embedded SmolLM2-135M."
    ),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Ask this once, stream the answer, exit."),
    system: str = typer.Option(None, "--system", help="System message to put before the prompt."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.7, "--temperature", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(-1, "--top-k", help="Keep the k most likely tokens; -1 is off."),
    seed: int = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Send the prompt as raw text."),
    cache_dir: str = typer.Option(
        None, "--cache-dir", help="Cache directory (default $TRTEDGE_CACHE_DIR or ~/.cache/trtedge)."
    ),
    max_input_len: int = typer.Option(4096, "--max-input-len", help="Longest prompt in tokens."),
    max_kv_cache_capacity: int = typer.Option(
        8192, "--max-kv-cache-capacity", help="Prompt + output tokens per request."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto|float32|bfloat16|float16."),
    device: str = typer.Option("auto", "--device", help="auto|cpu|cuda."),
    weights: str = typer.Option(
        "auto", "--weights", help="auto|float|int8 (auto keeps a quantized GGUF in int8 on the CPU)."
    ),
    engine_cache_max_size_gb: float = typer.Option(
        50.0, "--engine-cache-max-size-gb", help="Evict least-recently-used bundles past this many GiB."
    ),
    clear_engine_cache: bool = typer.Option(
        False, "--clear-engine-cache", help="Remove compiled bundles first (downloads are kept)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log loading details to stderr."),
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr
    )
    if prompt is None:
        typer.echo(
            "trtedge chat: the interactive chat is not available yet in this version; pass --prompt TEXT",
            err=True,
        )
        raise typer.Exit(2)
    from trtedge import LLM, CheckpointError, ConfigError, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
    except ValueError as e:
        _fail(f"--{str(e).split(' ', 1)[0].replace('_', '-')}: {e}")
    if model is None:
        typer.echo(
            "Using the embedded default model SmolLM2-135M-Instruct (pass MODEL to choose another).", err=True
        )
    try:
        llm = LLM(
            model,
            cache_dir=cache_dir,
            max_input_len=max_input_len,
            max_kv_cache_capacity=max_kv_cache_capacity,
            dtype=dtype,
            device=device,
            weights=weights,
            engine_cache_max_size_gb=engine_cache_max_size_gb,
            clear_engine_cache=clear_engine_cache,
        )
    except (CheckpointError, ConfigError, ValueError) as e:
        _fail(str(e))
    with llm:
        if no_chat_template:
            request = prompt
            options = {}
        else:
            request = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            options = {}
        try:
            stream = llm.generate_stream(request, params, **options)
        except ValueError as e:
            _fail(str(e))
        try:
            for delta in stream:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stream.cancel()
        sys.stdout.write("\n")


def _fail(message: str) -> None:
    typer.echo(f"trtedge chat: {message}", err=True)
    raise typer.Exit(2)
