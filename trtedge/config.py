"""Launch configuration shared by the CLI, the server and ``LLM``, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields

from trtedge.runtime.artifacts.choices import DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, WEIGHTS
from trtedge.runtime.models.ple import PleConfigError, PleRuntimeConfig
from trtedge.runtime.speculative import SpeculativeConfig, SpeculativeConfigError, check_supported

COMPONENTS = ("all", "llm")  # what a launch loads: everything the model has, or its language model only
DEFAULT_MAX_INPUT_LEN = 4096


class ConfigError(ValueError):
    """A launch setting is invalid; the message names the flag (and the Python argument)."""


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


@dataclass(frozen=True)
class ContextCacheConfig:
    """Context (prefix) reuse: full KV blocks are content-hashed and shared by later requests.

    ``recurrent_snapshot_pool_bytes`` bounds the snapshots of recurrent state that hybrid models
    (Qwen3.5) need to resume a cached prefix; None keeps 4 x max_batch_size snapshots.
    ``partial_kv_snapshot_pool_bytes`` keeps copies of the last, partly filled KV block at a
    published prefix end, so that a prefix that does not end on a block boundary is reused whole;
    0 (the default) reuses full blocks only."""

    enabled: bool = False
    max_records: int = 1024
    recurrent_snapshot_pool_bytes: int | None = None
    partial_kv_snapshot_pool_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"context_cache_config.enabled must be true or false, got {self.enabled!r}")
        if (
            isinstance(self.max_records, bool)
            or not isinstance(self.max_records, int)
            or self.max_records < 0
        ):
            raise ConfigError(
                f"context_cache_config.max_records (--context-cache-max-records) must be a non-negative "
                f"integer, got {self.max_records!r}"
            )
        pool = self.recurrent_snapshot_pool_bytes
        if pool is not None and (isinstance(pool, bool) or not isinstance(pool, int) or pool < 0):
            raise ConfigError(
                "context_cache_config.recurrent_snapshot_pool_bytes (--context-cache-recurrent-snapshot-pool-bytes) "
                f"must be a non-negative integer, got {pool!r}"
            )
        partial = self.partial_kv_snapshot_pool_bytes
        if isinstance(partial, bool) or not isinstance(partial, int) or partial < 0:
            raise ConfigError(
                "context_cache_config.partial_kv_snapshot_pool_bytes (--context-cache-partial-kv-snapshot-pool-bytes) "
                f"must be a non-negative integer, got {partial!r}"
            )

    @classmethod
    def coerce(cls, value) -> ContextCacheConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigError(
                    f"context_cache_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
            return cls(**value)
        raise ConfigError(f"context_cache_config must be a ContextCacheConfig or a mapping, got {value!r}")


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = None
    cache_dir: str | None = None
    max_input_len: int | None = None  # None: min(4096, max_kv_cache_capacity)
    max_kv_cache_capacity: int = 8192
    max_batch_size: int = 1
    max_num_batched_tokens: int = 2048
    enable_in_flight_batching: bool = False
    dtype: str = "auto"
    device: str = "auto"
    weights: str = "auto"
    kv_cache_dtype: str = "auto"  # "fp8": E4M3 KV cache (CUDA; see runtime.ops.kv_fp8)
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarking shapes)
    min_request_priority: int | None = None
    context_cache: ContextCacheConfig = ContextCacheConfig()
    engine_cache_max_size_gb: float = 50.0
    clear_engine_cache: bool = False
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None  # e.g. env:// under torchrun; None: a local TCP store
    speculative: SpeculativeConfig | None = None  # --speculative-config; also a dict or its JSON
    mm_embedding_cache_bytes: int = 512 * 2**20  # vision models: LRU cache of encoder outputs
    components: str = "all"  # "all" or "llm" (a vision-language model loaded text-only)
    ple: PleRuntimeConfig = PleRuntimeConfig()  # per-layer embeddings: where the table lives (no key change)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "ple", PleRuntimeConfig.coerce(self.ple))
        except PleConfigError as e:
            raise ConfigError(str(e)) from None
        try:
            object.__setattr__(self, "speculative", SpeculativeConfig.coerce(self.speculative))
            if self.speculative is not None:
                check_supported(self.speculative)
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from None
        from trtedge.runtime.artifacts.cache import BundleError, check_max_size_gb

        try:
            check_max_size_gb(self.engine_cache_max_size_gb)
        except BundleError as e:
            raise ConfigError(f"engine_cache_max_size_gb ({e})") from None
        for name in (
            "max_kv_cache_capacity",
            "max_input_len",
            "max_batch_size",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            if name == "max_input_len" and self.max_input_len is None:
                object.__setattr__(self, name, min(DEFAULT_MAX_INPUT_LEN, self.max_kv_cache_capacity))
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} ({_flag(name)}) must be a positive integer, got {value!r}")
        cache = self.mm_embedding_cache_bytes
        if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
            raise ConfigError(
                f"mm_embedding_cache_bytes (--mm-embedding-cache-bytes) must be a non-negative integer, got {cache!r}"
            )
        if self.components not in COMPONENTS:
            raise ConfigError(
                f"components (--components) must be one of {', '.join(COMPONENTS)}, got {self.components!r}"
            )
        if self.max_input_len > self.max_kv_cache_capacity:
            raise ConfigError(
                f"max_input_len (--max-input-len) {self.max_input_len} exceeds max_kv_cache_capacity "
                f"(--max-kv-cache-capacity) {self.max_kv_cache_capacity}"
            )
        for name, allowed in (
            ("dtype", DTYPES),
            ("device", DEVICES),
            ("weights", WEIGHTS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("load_format", LOAD_FORMATS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(
                    f"{name} ({_flag(name)}) must be one of {', '.join(allowed)}, got {value!r}"
                )
        if self.min_request_priority is not None and (
            isinstance(self.min_request_priority, bool) or not isinstance(self.min_request_priority, int)
        ):
            raise ConfigError(
                f"min_request_priority (--min-request-priority) must be an integer, got {self.min_request_priority!r}"
            )
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ConfigError(
                "--speculative-config with tensor_parallel_size (--tensor-parallel-size) > 1 is not "
                "supported yet: verification runs on rank 0 only"
            )
        if self.context_cache.partial_kv_snapshot_pool_bytes and self.tensor_parallel_size > 1:
            raise ConfigError(
                "partial_kv_snapshot_pool_bytes (--context-cache-partial-kv-snapshot-pool-bytes) with "
                "tensor_parallel_size (--tensor-parallel-size) > 1 is not supported yet"
            )
        method = self.distributed_init_method
        if method is not None and (not isinstance(method, str) or "://" not in method):
            raise ConfigError(
                f"distributed_init_method (--distributed-init-method) must be a URL such as env:// or "
                f"tcp://HOST:PORT, got {method!r}"
            )


def speculative_from_flags(
    speculative_config,
    draft_top_k: int | None = None,
    max_spec_draft_tokens: int | None = None,
    max_spec_verify_tokens: int | None = None,
) -> SpeculativeConfig | None:
    """``--speculative-config`` JSON with ``--draft-top-k``, ``--max-spec-draft-tokens`` and
    ``--max-spec-verify-tokens`` overriding its draft_top_k, num_speculative_tokens and verify_tokens."""
    flags = {
        "draft_top_k": ("--draft-top-k", draft_top_k),
        "num_speculative_tokens": ("--max-spec-draft-tokens", max_spec_draft_tokens),
        "verify_tokens": ("--max-spec-verify-tokens", max_spec_verify_tokens),
    }
    try:
        config = SpeculativeConfig.coerce(speculative_config)
        given = {key: value for key, (_, value) in flags.items() if value is not None}
        if config is None:
            if given:
                names = ", ".join(flags[key][0] for key in given)
                raise ConfigError(f"{names} needs --speculative-config (which method drafts the tokens)")
            return None
        return config.replace(**given)
    except SpeculativeConfigError as e:
        for key, (flag, value) in flags.items():
            if value is not None and key in str(e):
                raise ConfigError(f"{flag}: {e}") from None
        raise ConfigError(str(e)) from None
