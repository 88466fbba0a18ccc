"""SamplingParams: per-request generation settings, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. A bad value raises ``ValueError`` naming the field.

    ``temperature=0`` is greedy; ``top_k=-1`` disables top-k; ``seed`` (unsigned 64-bit) makes a
    sampled request reproducible whatever else is in the batch.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    reuse_context: bool = True
    cache_generated_tokens: bool = True
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _int("max_tokens", self.max_tokens, lo=1)
        _num("temperature", self.temperature, lo=0.0)
        _num("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _int("top_k", self.top_k, lo=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or a positive integer, got 0")
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        _num("repetition_penalty", self.repetition_penalty, lo=0.0)
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _int("seed", self.seed, lo=0, hi=2**64 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, lo=0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        _int("n", self.n, lo=1, hi=128)
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(
                    f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} allowed"
                )
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    token = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                _int("logit_bias token id", token, lo=0)
                _num(f"logit_bias[{token}]", v, lo=-100.0, hi=100.0)
                bias[token] = float(v)
            object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _range(name, value, lo, hi)


def _num(name: str, value, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    _range(name, value, lo, hi)


def _range(name, value, lo, hi) -> None:
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
