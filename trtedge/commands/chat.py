"""`trtedge chat [MODEL]`: the interactive terminal chat, or one answer for --prompt or piped stdin."""

from __future__ import annotations

import logging
import sys
import time

import typer

from trtedge.commands.completion import cached_models
from trtedge.commands.exit_codes import FAILED, INTERRUPTED, USAGE
from trtedge.commands.launch_options import CACHE, PRECISION, SPECULATIVE, launch_options, llm_options

HELP = (
    "Chat with a model in the terminal: streamed answers, then time to first token, tokens/s, latency "
    "and context use. With --prompt, or text piped on stdin, answer once to stdout and exit. "
    "With --url, talk to a running trtedge serve (or any OpenAI-compatible server)."
)


@launch_options(
    *CACHE,
    "max_input_len",
    "max_kv_cache_capacity",
    "enable_context_reuse",
    *PRECISION,
    *SPECULATIVE,
    "tensor_parallel_size",
)
def chat(
    model: str = typer.Argument(
        None,
        autocompletion=cached_models,
        help="HF id, local HF directory or .gguf file; default: embedded SmolLM2-135M. "
        "With --url: the model id to ask the server for (default: its first).",
    ),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Ask this once, stream the answer, exit."),
    system: str = typer.Option(None, "--system", help="System message to put before the prompt."),
    url: str = typer.Option(
        None, "--url", help="Chat with the OpenAI-compatible server at this URL instead of a local model."
    ),
    api_key: str = typer.Option(
        None, "--api-key", envvar="TRTEDGE_API_KEY", help="Bearer key for --url (also $TRTEDGE_API_KEY)."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.7, "--temperature", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(-1, "--top-k", help="Keep the k most likely tokens; -1 is off."),
    seed: int = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Send the prompt as raw text."),
    markdown: bool = typer.Option(
        True, "--markdown/--no-markdown", help="Render finished answers as Markdown (interactive)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log loading details to stderr."),
    launch: dict | None = None,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr
    )
    from trtedge.runtime.sampling_params import ParamError, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
    except ParamError as e:
        _fail(f"--{e.param.replace('_', '-')}: {e}")
    try:
        llm_kwargs = llm_options(launch)
    except ValueError as e:
        _fail(str(e))
    # A session needs a terminal on both ends; `trtedge chat > answer.txt` reads the question from stdin.
    interactive = prompt is None and sys.stdin.isatty() and sys.stdout.isatty()
    if prompt is None and not interactive:
        prompt = sys.stdin.read()
        if not prompt.strip():
            _fail("stdin is empty: pipe a question in, pass --prompt TEXT, or run in a terminal")
    if no_chat_template and interactive:
        _fail("--no-chat-template needs --prompt or piped stdin")

    try:
        if url is not None:
            backend = _http_backend(url, api_key, model)
        else:
            backend = _local_backend(model, interactive, **llm_kwargs)
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    # A server applies its own template; a local model may have none of its own (a base model).
    origin = "model" if url is not None or no_chat_template else backend.chat_template_origin
    if origin != "model":
        typer.echo(f"trtedge chat: warning: {_TEMPLATE_WARNINGS[origin, interactive]}", err=True)
    try:
        if interactive:
            from trtedge.chat.session import ChatSession
            from trtedge.chat.tui import ChatApp

            session = ChatSession(params, system=system, max_context=backend.max_context)
            raise typer.Exit(ChatApp(backend, session, markdown=markdown).run())
        raw = no_chat_template or origin is None  # with no template, the prompt goes as it is
        request = prompt if raw else _messages(system, prompt)
        _answer_once(backend, request, params, verbose)
    finally:
        backend.close()


_BASE_MODEL = (
    "this model's file has no chat template, so it is probably a base model, not an instruction-tuned "
    "one: trtedge applies its family's turn format, but the answers may continue or repeat the prompt "
    "rather than answer it. Use an instruction-tuned model to chat"
)
_TEMPLATE_WARNINGS = {
    ("default", True): _BASE_MODEL + ".",
    ("default", False): _BASE_MODEL + " (--no-chat-template sends the prompt as raw text to continue).",
    (None, True): "this model has no chat template (a base model?): messages cannot be rendered; ask once "
    "with --prompt to send raw text, or use an instruction-tuned model",
    (None, False): "this model has no chat template (a base model?): the prompt is sent as raw text, "
    "which the model continues rather than answers",
}


def _local_backend(model, interactive: bool, **llm_kwargs):
    from trtedge import LLM, CheckpointError, ConfigError
    from trtedge.chat.backends import LocalBackend

    if model is None:
        typer.echo(
            "Using the embedded default model SmolLM2-135M-Instruct (pass MODEL to choose another).", err=True
        )
    try:
        llm = _load_showing_the_build(LLM, model, llm_kwargs) if interactive else LLM(model, **llm_kwargs)
    except (CheckpointError, ConfigError, ValueError) as e:
        _fail(str(e))
    return LocalBackend(llm)


def _load_showing_the_build(LLM, model, llm_kwargs: dict):
    """LLM(...) under a spinner that says when this launch builds the model's bundle (the first launch
    of a model does, once), then how long that took."""
    from rich.console import Console

    console = Console(stderr=True)
    start = time.perf_counter()
    with console.status("loading the model…") as status:

        def progress(stage: str, done: int, total: int | None) -> None:
            count = f" {done}/{total}" if total else ""
            status.update(
                f"building the bundle for this model (once: later launches load it from the cache)… "
                f"{stage}{count}"
            )

        llm = LLM(model, **llm_kwargs, build_progress=progress)
    if llm.describe().bundle_built:
        console.print(
            f"built the bundle once in {time.perf_counter() - start:.1f} s; later launches of this model "
            "load it from the cache",
            style="dim",
            highlight=False,
        )
    return llm


def _http_backend(url: str, api_key: str | None, model: str | None):
    from trtedge.chat.backends import BackendError, HttpBackend

    try:
        return HttpBackend(url, api_key, model)
    except BackendError as e:
        _fail(f"--url: {e}")


def _messages(system: str | None, prompt: str) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": prompt}]


def _answer_once(backend, request, params, verbose: bool) -> None:
    """Stream the answer's text to stdout (reasoning sent apart by a server is left out)."""
    from trtedge.chat.backends import BackendError
    from trtedge.chat.session import format_metrics

    try:
        stream = backend.stream(request, params)
    except (BackendError, ValueError) as e:
        _fail(str(e))
    try:
        for chunk in stream:
            if not chunk.reasoning:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:  # the answer is cut short: say so to a script, as the shell does
        stream.cancel()
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise typer.Exit(INTERRUPTED) from None
    except BackendError as e:
        sys.stdout.write("\n")
        typer.echo(f"trtedge chat: {e}", err=True)
        raise typer.Exit(FAILED) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    metrics = stream.wait_metrics(2.0)
    if verbose and metrics is not None:
        typer.echo(format_metrics(metrics, backend.max_context), err=True)


def _fail(message: str) -> None:
    typer.echo(f"trtedge chat: {message}", err=True)
    raise typer.Exit(USAGE)
