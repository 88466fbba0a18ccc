"""What ``LLM``'s client interface returns: plain, frozen data that every front door (the server, the
commands, chat, bench) reads instead of the engine, its runner, model or tokenizer.

``ModelInfo`` and ``EngineStats`` also read as the dicts they replaced (``stats["running"]``,
``stats.get("ple_cache")``, ``dict(info)``); ``to_dict()`` gives a plain dict (for JSON)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class _Figures(Mapping):
    """A frozen dataclass that reads as a mapping of its fields: the ``_OPTIONAL`` ones only when set,
    then ``extra`` (figures of a newer engine than this class names)."""

    _OPTIONAL: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "extra" and (f.name not in self._OPTIONAL or getattr(self, f.name) is not None)
        }
        return {**out, **self.extra}

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **more: Any):
        names = {f.name for f in fields(cls)} - {"extra"}
        values = {**values, **more}
        known = {k: v for k, v in values.items() if k in names}
        return cls(**known, extra={k: v for k, v in values.items() if k not in names})


@dataclass(frozen=True, eq=False)
class ModelInfo(_Figures):
    """What is loaded (``llm.describe()``): the device and dtype it runs in, the bytes of its weights
    and of one token's KV cache, its vocabulary size (the model's: logits and valid token ids), its
    family, whether the engine schedules asynchronously and runs in its own process, and where the
    weights were read from."""

    device: str
    dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    vocab_size: int
    model_type: str
    async_scheduling: bool
    engine_process: bool
    bundle_key: str | None = None  # the runtime bundle's cache key (None: weights from the checkpoint)
    loaded_from: str = ""  # the bundle's or the checkpoint's folder
    bundle_built: bool = False  # this launch built the bundle (a later one loads it from the cache)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """Where the weights came from, in a line: "bundle KEY (PATH)" or "checkpoint PATH"."""
        if self.bundle_key is None:
            return f"checkpoint {self.loaded_from}"
        return f"bundle {self.bundle_key} ({self.loaded_from})"


@dataclass(frozen=True, eq=False)
class EngineStats(_Figures):
    """A snapshot of the engine (``llm.stats()``): requests now (active, running, waiting), the KV pool,
    totals since start, and ``engine_error`` (None while it serves). The ``state_slots_*`` and
    ``recurrent_state_bytes`` figures are there for hybrid models only, ``ple_cache`` for per-layer
    embedding models, ``mm_embedding_cache`` for models with a vision or audio component, ``gc`` for
    an engine core in its own process (its garbage collector's collections and seconds)."""

    _OPTIONAL = frozenset(
        {
            "state_slots_total",
            "state_slots_free",
            "recurrent_state_bytes",
            "ple_cache",
            "mm_embedding_cache",
            "gc",
        }
    )

    model: str
    active_requests: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    kv_cache_bytes: int
    submitted: int
    completed: int
    cancelled: int
    failed: int
    joined_mid_flight: int
    preemptions: int
    steps: int
    restarts: int
    engine_error: str | None
    speculative: dict | None = None
    state_slots_total: int | None = None
    state_slots_free: int | None = None
    recurrent_state_bytes: int | None = None
    ple_cache: dict | None = None
    mm_embedding_cache: dict | None = None
    gc: dict | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer as plain data (``llm.tokenizer_info()``): its special tokens, whether it adds BOS,
    its own vocabulary size (added tokens included; the model's may be larger), the chat templates
    by name ("default", "tool_use", ...) and the default one (None: the checkpoint has none)."""

    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    special_tokens: dict[str, str]
    add_bos_token: bool
    vocab_size: int
    chat_template: str | None
    chat_templates: dict[str, str]

    def template_for(self, tools: bool) -> str:
        """The template source a request renders with (the "tool_use" one when it sends tools)."""
        return self.chat_templates.get("tool_use" if tools else "default") or self.chat_template or ""


@dataclass(frozen=True)
class RenderedChat:
    """A conversation through the chat template (``llm.render_chat()``): its text, its token ids, and
    the prompt to generate from (``ids``, or a ``MultimodalPrompt`` when it holds media)."""

    text: str
    ids: list[int]
    prompt: Any
