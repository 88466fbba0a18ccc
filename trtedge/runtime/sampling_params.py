"""SamplingParams: per-request generation settings, validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20
MAX_GUIDE_BYTES = 128 * 1024
GUIDE_KINDS = ("json", "json_object", "regex", "ebnf", "structural_tag", "choice")


class ParamError(ValueError):
    """A bad value of one request field: ``param`` names it (``top_p``, ``guided_decoding.regex``), so a
    front door can say which field is wrong without reading the message."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return type(self), (self.param, str(self))


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain the output to a guide; set exactly one of ``json`` (a JSON schema, dict or text),
    ``json_object`` (any JSON object), ``regex``, ``ebnf`` (a GBNF grammar), ``structural_tag`` (xgrammar's
    structural tag, dict or text) or ``choice`` (a list of strings). ``strict`` (JSON schemas) allows no
    properties or items beyond those the schema names. ``jump_forward`` appends the tokens the guide forces
    with fewer model passes; the output is the same as without it."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: dict | str | None = None
    choice: tuple[str, ...] | None = None
    strict: bool = True
    jump_forward: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise ParamError(
                    "guided_decoding.choice", "guided_decoding.choice must be a list of non-empty strings"
                )
            if not self.choice:
                raise ParamError("guided_decoding.choice", "guided_decoding.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (dict, str)):
                raise ParamError(
                    f"guided_decoding.{name}", f"guided_decoding.{name} must be an object or a JSON string"
                )
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ParamError(
                        f"guided_decoding.{name}", f"guided_decoding.{name} is not valid JSON: {e}"
                    ) from None
                if not isinstance(parsed, dict):
                    raise ParamError(
                        f"guided_decoding.{name}", f"guided_decoding.{name} must be a JSON object"
                    )
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParamError(
                    f"guided_decoding.{name}", f"guided_decoding.{name} must be a non-empty string"
                )
        chosen = [k for k in GUIDE_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ParamError(
                "guided_decoding",
                f"guided_decoding needs exactly one of {', '.join(GUIDE_KINDS)}; got "
                + (", ".join(chosen) if chosen else "none"),
            )
        size = len(self.key[1].encode())
        if size > MAX_GUIDE_BYTES:
            raise ParamError(
                f"guided_decoding.{chosen[0]}",
                f"guided_decoding.{chosen[0]} is {size} bytes; at most {MAX_GUIDE_BYTES} allowed",
            )

    @classmethod
    def coerce(cls, value) -> GuidedDecodingParams | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ParamError(
                    "guided_decoding", f"guided_decoding has unknown field(s): {', '.join(sorted(unknown))}"
                )
            return cls(**value)
        raise ParamError(
            "guided_decoding",
            f"guided_decoding must be a GuidedDecodingParams or a dict, got {type(value).__name__}",
        )

    @property
    def kind(self) -> str:
        return next(k for k in GUIDE_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on."""
        kind = self.kind
        if kind == "json_object":
            return "json", '{"type": "object"}'
        value = getattr(self, kind)
        if kind == "choice":
            return kind, json.dumps(list(value), ensure_ascii=False)
        if kind in ("json", "structural_tag"):
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return ("json_strict" if kind == "json" and self.strict else kind), text
        return kind, value


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
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (and this many top alternatives)
    n: int = 1
    reuse_context: bool = True
    cache_generated_tokens: bool | None = None  # None: True, but False where a hybrid model speculates
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    disable_spec_decode: bool = False  # generate this request without speculative decoding
    cache_salt: str | None = None  # requests with different salts never share cached KV blocks

    def __post_init__(self) -> None:
        object.__setattr__(self, "guided_decoding", GuidedDecodingParams.coerce(self.guided_decoding))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _int("max_tokens", self.max_tokens, lo=1)
        _num("temperature", self.temperature, lo=0.0)
        _num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("top_k", self.top_k, lo=-1)
        if self.top_k == 0:
            raise ParamError("top_k", "top_k must be -1 (off) or a positive integer, got 0")
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        _num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _int("seed", self.seed, lo=0, hi=2**64 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop", f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, lo=0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        _int("n", self.n, lo=1, hi=128)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ParamError("cache_salt", f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ParamError(
                    "logit_bias",
                    f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} allowed",
                )
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    token = int(k)
                except (TypeError, ValueError):
                    raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {k!r}") from None
                _int("logit_bias token id", token, lo=0)
                _num(f"logit_bias[{token}]", v, lo=-100.0, hi=100.0)
                bias[token] = float(v)
            object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _field(name: str) -> str:
    """The request field a check's name is about: "logit_bias[5]" and "logit_bias token id" are logit_bias."""
    return name.split(" ", 1)[0].split("[", 1)[0]


def _int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(_field(name), f"{name} must be an integer, got {value!r}")
    _range(name, value, lo, hi)


def _num(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(_field(name), f"{name} must be a finite number, got {value!r}")
    _range(name, value, lo, hi, lo_open)


def _range(name, value, lo, hi, lo_open: bool = False) -> None:
    """One rule, one message: every value outside the range gets the same wording (`lo_open`: lo excluded)."""
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if below or hi is not None and value > hi:
        if lo_open:
            bounds = f"in ({lo:g}, {hi:g}]" if hi is not None else f"> {lo:g}"
        else:
            bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ParamError(_field(name), f"{name} must be {bounds}, got {value!r}")


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ParamError(
            "logit_bias",
            f"logit_bias token id {max(params.logit_bias)} is not below the vocabulary size {vocab_size}",
        )
