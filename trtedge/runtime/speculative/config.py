"""SpeculativeConfig: which proposer drafts tokens and how many the target verifies per step."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

AVAILABLE_METHODS = ("draft_model", "eagle3", "ngram", "mtp", "dflash")
# The reference server's other methods: parsed (with its names and defaults), refused at launch
# (``check_supported``) until trtedge runs them.
UNAVAILABLE_METHODS = ("jetspec", "dspark", "domino")
METHODS = AVAILABLE_METHODS + UNAVAILABLE_METHODS
# need a draft checkpoint in "model" (domino: no public definition says; a model is allowed, not required)
MODEL_METHODS = ("draft_model", "eagle3", "dflash", "jetspec", "dspark")
DEFAULT_NUM_SPECULATIVE_TOKENS = {
    "draft_model": 4,
    "eagle3": 4,
    "ngram": 4,
    "mtp": 1,
    "dflash": 15,  # one block of 16 (the anchor and 15 proposals)
    "jetspec": 16,
    "dspark": 7,
    "domino": 4,
}
TREE_METHODS = ("eagle3", "dflash", "mtp")  # draft_top_k > 1: a token tree (mtp: with a Gemma 4 assistant)
# a token tree's verify_tokens default: the reference server's 60 verification positions for EAGLE and
# MTP trees (dflash: min(depth x top_k, 64), a block's candidates); a chain's is its depth
TREE_VERIFY_TOKENS = {"eagle3": 60, "mtp": 60}
FLAG = "--speculative-config"


class SpeculativeConfigError(ValueError):
    """An invalid speculative setting; the message names the key (and the flag)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` / ``LLM(speculative_config=...)``.

    ``num_speculative_tokens``: draft depth (tokens proposed per step along a path).
    ``draft_top_k``: children kept per tree level (eagle3, mtp with a Gemma 4 assistant; dflash:
    candidates per block position; 1 = a linear chain).
    ``verify_tokens``: most draft tokens the target scores in one step (tree size cap).
    ``prompt_lookup_min``/``prompt_lookup_max``: n-gram lengths the ngram method matches.
    """

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    draft_top_k: int = 1
    verify_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"{FLAG} method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            raise SpeculativeConfigError(f"{FLAG} method {self.method} needs model (the draft checkpoint)")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise SpeculativeConfigError(f"{FLAG} model must be a non-empty string, got {self.model!r}")
        if self.method not in (*MODEL_METHODS, "mtp", "domino") and self.model is not None:
            raise SpeculativeConfigError(
                f"{FLAG} model is only used by {', '.join(MODEL_METHODS)} and mtp (a Gemma 4 assistant)"
            )
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS[self.method])
        for name in ("num_speculative_tokens", "draft_top_k", "prompt_lookup_min", "prompt_lookup_max"):
            _positive(name, getattr(self, name))
        if self.verify_tokens is None:
            k, top = self.num_speculative_tokens, self.draft_top_k
            tree = TREE_VERIFY_TOKENS.get(self.method, min(k * top, 64))
            object.__setattr__(self, "verify_tokens", k if top == 1 else tree)
        _positive("verify_tokens", self.verify_tokens)
        if self.verify_tokens < self.num_speculative_tokens and self.draft_top_k == 1:
            raise SpeculativeConfigError(
                f"{FLAG} verify_tokens ({self.verify_tokens}) must be at least num_speculative_tokens "
                f"({self.num_speculative_tokens}) for a linear chain"
            )
        if self.draft_top_k > 1 and self.method == "mtp" and self.model is None:
            raise SpeculativeConfigError(
                f"{FLAG} draft_top_k > 1 (tree drafting) with method mtp needs model (a Gemma 4 assistant): "
                "the checkpoints with their own MTP layers (Qwen3.5, Qwen3-Next, Nemotron-H) are hybrid "
                "models, which verify linear chains only"
            )
        if self.draft_top_k > 1 and self.method not in TREE_METHODS:
            raise SpeculativeConfigError(
                f"{FLAG} draft_top_k > 1 (tree drafting) needs method eagle3, dflash or mtp (with a Gemma 4 "
                "assistant model)"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(f"{FLAG} prompt_lookup_min must not exceed prompt_lookup_max")

    @property
    def is_tree(self) -> bool:
        return self.draft_top_k > 1

    @property
    def needs_model(self) -> bool:
        return self.method in MODEL_METHODS

    def replace(self, **overrides) -> SpeculativeConfig:
        """A copy with the given keys changed (None values are ignored: flags left unset)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        if overrides.get("verify_tokens") is None:  # keep a cap that still fits the new shape
            auto = SpeculativeConfig(**{**values, "verify_tokens": None}).verify_tokens
            values["verify_tokens"] = max(auto, self.verify_tokens)
        return SpeculativeConfig(**values)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def coerce(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a mapping or its JSON text -> a validated config (or None)."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise SpeculativeConfigError(f"{FLAG} is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"{FLAG} must be a JSON object, got {value!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SpeculativeConfigError(
                f"{FLAG}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        if "method" not in value:
            raise SpeculativeConfigError(f"{FLAG} needs method (one of {', '.join(METHODS)})")
        return cls(**value)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpeculativeConfigError(f"{FLAG} {name} must be a positive integer, got {value!r}")
