"""What a step hands back to the scheduler, and what the scheduler hands on: plain data keyed by
request id (no tensors, no live objects), so that a runner in another process, a tensor-parallel
rank or a test can produce it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelRunnerOutput:
    """A step's samples. ``sampled_token_ids``: per request that sampled, in the step's order, its
    sampled ids: one, or ``k + 1`` for the positions of a ``k``-token jump-forward draft, or the
    tokens a speculative step accepted. ``logprobs``: per request that asked for them, one entry per
    sampled id (``TokenLogprobs`` or None)."""

    sampled_token_ids: dict[str, tuple[int, ...]]
    logprobs: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, request_ids: list[str], tokens: list[int], infos: list | None = None):
        """From one row per sample, a request's rows next to each other (a draft's positions)."""
        if (infos is None or not any(infos)) and len(set(request_ids)) == len(request_ids):
            return cls({rid: (token,) for rid, token in zip(request_ids, tokens)})  # a row a request
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        for row, (rid, token) in enumerate(zip(request_ids, tokens)):
            sampled.setdefault(rid, []).append(token)
            info = infos[row] if infos is not None else None
            if info is not None or rid in logprobs:
                logprobs.setdefault(rid, [None] * (len(sampled[rid]) - 1)).append(info)
        return cls(
            {rid: tuple(ids) for rid, ids in sampled.items()},
            {rid: tuple(lps) for rid, lps in logprobs.items()},
        )


@dataclass(slots=True)  # not frozen: a frozen init costs ~4x, one of these a request a step
class EngineCoreOutput:
    """One request's part of a step, after the scheduler's bookkeeping: the tokens it kept (drafts
    verified, stops applied), and why it finished if it did. The engine's output side makes the
    text, the deltas and the metrics from it, and finishes the request when ``finish_reason`` is set.

    ``rejected``: the sampled token the guide refused (not kept), or None. ``num_accepted_draft``: the
    jump-forward draft tokens the model agreed with. ``rolled_back``: a draft's rejected positions
    were cut from the KV cache (the runner rolls back the rest of their state)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[Any, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | None
    stop_token: bool = False  # the last kept token ended the request as a stop token
    rejected: int | None = None
    num_accepted_draft: int = 0
    rolled_back: bool = False
