"""The figures ``LLM``'s getters return: small frozen dataclasses that also convert to a dict."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ContextCacheMetrics:
    """Context reuse since the ``LLM`` started (``llm.get_context_cache_metrics()``).

    ``lookups``: requests that looked for a cached prefix; ``hits``: those that reused one;
    ``reused_tokens``: prompt tokens taken from the cache; ``records``: full blocks recorded now;
    ``evictions``: records dropped. The ``recurrent_snapshot*`` fields (hybrid models, such as
    Qwen3.5) are None for other models; the ``partial_kv_*`` fields are None without a partial-block
    pool (``ContextCacheConfig(partial_kv_snapshot_pool_bytes=...)``), and
    ``partial_kv_reused_tokens`` counts the part of ``reused_tokens`` taken from it."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    records: int = 0
    evictions: int = 0
    recurrent_snapshots: int | None = None  # held now
    recurrent_snapshot_capacity: int | None = None
    recurrent_snapshot_evictions: int | None = None
    recurrent_snapshot_pool_bytes: int | None = None
    partial_kv_snapshots: int | None = None  # held now
    partial_kv_snapshot_capacity: int | None = None
    partial_kv_snapshot_evictions: int | None = None
    partial_kv_snapshot_pool_bytes: int | None = None
    partial_kv_reused_tokens: int | None = None

    def to_dict(self) -> dict[str, int]:
        """The fields that apply to this model, as a dict."""
        return {key: value for key, value in asdict(self).items() if value is not None}
