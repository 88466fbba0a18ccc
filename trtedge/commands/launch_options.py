"""The launch flags (what ``LaunchConfig`` holds: the model's limits, precision, device, caches,
speculative decoding, tensor parallelism), each declared once here and shared by `serve`, `chat`,
`build` and `bench`: ``@launch_options(...)`` adds the ones a command takes to its signature (after its
own flags) and hands their values to it as one ``launch`` dict; ``llm_options`` turns that dict into
``LLM(...)`` arguments. The choice lists come from ``trtedge.runtime.artifacts.choices``.

Nothing here imports torch (the flags are read for every `--help`)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import typer

from trtedge.commands import DRAFT_STEP_FLAGS, VERIFY_TOKENS_FLAGS
from trtedge.runtime.artifacts.choices import DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, WEIGHTS

_SAME = object()


@dataclass(frozen=True)
class LaunchFlag:
    type: type
    default: object
    help: str
    decls: tuple[str, ...] = ()  # default: --the-name
    envvar: str | None = None

    def option(self, name: str, default=_SAME, help: str | None = None, prefix: str = ""):
        text = help or self.help
        if prefix:  # "Offline: split the model ..." (a choice list or a JSON example keeps its case)
            text = prefix + (text[0].lower() + text[1:] if text[1:2].islower() else text)
        decls = self.decls or (f"--{name.replace('_', '-')}",)
        value = self.default if default is _SAME else default
        return typer.Option(value, *decls, help=text, envvar=self.envvar)


FLAGS: dict[str, LaunchFlag] = {
    "cache_dir": LaunchFlag(
        str,
        None,
        "Cache directory (default $TRTEDGE_CACHE_DIR or ~/.cache/trtedge).",
        envvar="TRTEDGE_CACHE_DIR",
    ),
    "engine_cache_max_size_gb": LaunchFlag(
        float, 50.0, "Evict least-recently-used bundles past this many GiB."
    ),
    "clear_engine_cache": LaunchFlag(
        bool, False, "Remove compiled bundles before loading (downloaded checkpoints are kept)."
    ),
    "max_input_len": LaunchFlag(
        int, None, "Longest prompt in tokens (default: min(4096, --max-kv-cache-capacity))."
    ),
    "max_batch_size": LaunchFlag(int, 1, "Most requests generating together."),
    "max_kv_cache_capacity": LaunchFlag(int, 8192, "Prompt + output tokens per request."),
    "enable_in_flight_batching": LaunchFlag(
        bool, False, "New requests join the running batch at the next step."
    ),
    "min_request_priority": LaunchFlag(int, None, "Refuse requests whose priority is below this."),
    "enable_context_reuse": LaunchFlag(bool, False, "Reuse the KV cache of shared prompt prefixes."),
    "context_cache_max_records": LaunchFlag(int, 1024, "Most cached prefix blocks kept for reuse."),
    "context_cache_recurrent_snapshot_pool_bytes": LaunchFlag(
        int,
        None,
        "Hybrid models (Qwen3.5): bytes of recurrent-state snapshots kept for reuse (default: 4 x "
        "--max-batch-size snapshots).",
    ),
    "context_cache_partial_kv_snapshot_pool_bytes": LaunchFlag(
        int,
        0,
        "Bytes of snapshots of a prefix's last, partly filled KV block, so that a prefix reuses its "
        "partial block too (0: full blocks only).",
    ),
    "mm_embedding_cache_bytes": LaunchFlag(
        int,
        512 * 2**20,
        "Vision models: bytes of image/video encoder outputs kept for repeated media (0: off).",
    ),
    "ple_residency": LaunchFlag(
        str,
        "resident",
        "Gemma 3n / Gemma 4: resident (the per-layer embedding table on the device) or cached "
        "(on the host, a pool of --ple-cache-slots rows on the device).",
    ),
    "ple_cache_slots": LaunchFlag(
        int, None, "--ple-residency cached: rows in the device pool (>= 2; slot 0 is padding)."
    ),
    "ple_file": LaunchFlag(
        str,
        None,
        "A safetensors file holding the per-layer embedding table, read instead of the checkpoint's.",
    ),
    "speculative_config": LaunchFlag(
        str,
        None,
        'JSON {"method": "ngram|draft_model|eagle3|mtp|dflash", "model": ..., "num_speculative_tokens": k, '
        '"draft_top_k": t, "verify_tokens": v}.',
    ),
    "draft_top_k": LaunchFlag(
        int,
        None,
        "Children per draft-tree level (eagle3; dflash: candidates per block position); overrides draft_top_k.",
    ),
    "max_spec_draft_tokens": LaunchFlag(
        int,
        None,
        "Draft depth (proposal tokens) per step; overrides num_speculative_tokens.",
        DRAFT_STEP_FLAGS,
    ),
    "max_spec_verify_tokens": LaunchFlag(
        int, None, "Most draft tokens verified per step; overrides verify_tokens.", VERIFY_TOKENS_FLAGS
    ),
    "dtype": LaunchFlag(str, "auto", f"{'|'.join(DTYPES)}."),
    "device": LaunchFlag(str, "auto", f"{'|'.join(DEVICES)}."),
    "weights": LaunchFlag(
        str,
        "auto",
        f"{'|'.join(WEIGHTS)} (auto: a GGUF or pre-quantized checkpoint keeps its class; fp8: CUDA only).",
    ),
    "kv_cache_dtype": LaunchFlag(
        str,
        "auto",
        f"{'|'.join(KV_CACHE_DTYPES)} (auto: the model's dtype; fp8: E4M3 with a scale per head of each "
        "token, about half the KV memory and attention reads; CUDA only; fp16: float16 keys and values, half "
        "the KV memory of float32; CPU only; int8: int8 with a scale per head of each token, about a quarter "
        "of float32's; CPU only).",
    ),
    "load_format": LaunchFlag(
        str,
        "auto",
        f"{'|'.join(LOAD_FORMATS)}. dummy: random weights from config.json alone, to measure a model's shape.",
    ),
    "tensor_parallel_size": LaunchFlag(
        int,
        1,
        "Split the model over N GPUs (CPU: N processes); N must divide the attention and KV heads.",
    ),
    "distributed_init_method": LaunchFlag(
        str,
        None,
        "torch.distributed rendezvous URL (env:// under torchrun, tcp://HOST:PORT); default: local.",
    ),
}

CACHE = ("cache_dir", "engine_cache_max_size_gb", "clear_engine_cache")
PRECISION = ("dtype", "device", "weights", "kv_cache_dtype")
SPECULATIVE = ("speculative_config", "draft_top_k", "max_spec_draft_tokens", "max_spec_verify_tokens")
CONTEXT_CACHE = (
    "enable_context_reuse",
    "context_cache_max_records",
    "context_cache_recurrent_snapshot_pool_bytes",
    "context_cache_partial_kv_snapshot_pool_bytes",
)
PLE = ("ple_residency", "ple_cache_slots", "ple_file")


def launch_options(*names: str, prefix: str = "", changed: dict[str, tuple] | None = None):
    """Add the launch flags ``names`` to a Typer command, which takes them as one keyword argument
    ``launch`` ({name: value}). ``prefix`` starts each one's help ("Offline: "); ``changed``: name ->
    (default, help) where this command's flag means something more particular (None keeps the help)."""
    changed = changed or {}
    unknown = set(names) - set(FLAGS) | set(changed) - set(names)
    if unknown:
        raise ValueError(f"unknown launch flag(s): {', '.join(sorted(unknown))}")

    def wrap(command):
        sig = inspect.signature(command)
        own = [p for p in sig.parameters.values() if p.name != "launch"]
        added = []
        for name in names:
            default, help = changed.get(name, (_SAME, None))
            option = FLAGS[name].option(name, default, help, prefix)
            kind, annotation = inspect.Parameter.KEYWORD_ONLY, FLAGS[name].type
            added.append(inspect.Parameter(name, kind, default=option, annotation=annotation))

        @functools.wraps(command)
        def run(*args, **kwargs):
            launch = {name: kwargs.pop(name) for name in names}
            return command(*args, **kwargs, launch=launch)

        run.__signature__ = sig.replace(parameters=[*own, *added])
        annotations = {k: v for k, v in command.__annotations__.items() if k != "launch"}
        run.__annotations__ = {**annotations, **{name: FLAGS[name].type for name in names}}
        return run

    return wrap


def llm_options(launch: dict) -> dict:
    """``LLM(...)`` keyword arguments for the launch flags a command took. Raises ``ValueError`` (a
    ``ConfigError`` or the speculative flags' error) naming the flag."""
    from trtedge.config import ContextCacheConfig, speculative_from_flags

    grouped = {*SPECULATIVE, *CONTEXT_CACHE, *PLE}
    out = {k: v for k, v in launch.items() if k not in grouped}
    if any(k in launch for k in CONTEXT_CACHE):
        defaults = ContextCacheConfig()
        out["context_cache_config"] = ContextCacheConfig(
            launch.get("enable_context_reuse", defaults.enabled),
            launch.get("context_cache_max_records", defaults.max_records),
            launch.get("context_cache_recurrent_snapshot_pool_bytes", defaults.recurrent_snapshot_pool_bytes),
            launch.get(
                "context_cache_partial_kv_snapshot_pool_bytes", defaults.partial_kv_snapshot_pool_bytes
            ),
        )
    if any(k in launch for k in SPECULATIVE):
        out["speculative_config"] = speculative_from_flags(*(launch.get(k) for k in SPECULATIVE))
    if any(k in launch for k in PLE):
        out["ple_config"] = {
            "residency": launch.get("ple_residency", "resident"),
            "cache_slots": launch.get("ple_cache_slots"),
            "file_path": launch.get("ple_file"),
        }
    return out


def launch_config(model: str | None, options: dict):
    """The validated ``LaunchConfig`` of ``LLM(model, **options)``, before anything loads."""
    from trtedge.config import LaunchConfig

    renamed = {
        "context_cache_config": "context_cache",
        "speculative_config": "speculative",
        "ple_config": "ple",
    }
    return LaunchConfig(model=model, **{renamed.get(k, k): v for k, v in options.items()})
