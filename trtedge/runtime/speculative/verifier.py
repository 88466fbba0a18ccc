"""Acceptance of a draft against the target's scores for every draft node.

Greedy requests accept the longest path whose tokens equal the target's argmax at each step.
Sampled requests use recursive rejection sampling with deterministic drafts: at a node, each child
token ``x`` is accepted with probability ``p(x)`` under the current residual ``p``; a rejected
child's token is removed from ``p`` (renormalised) before the next child is tried; when no child is
accepted the bonus token is drawn from the residual. Every emitted token is therefore distributed
exactly as the target's sampler would draw it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.sampler import exponential_noise, mix_seed, sampling_probs
from trtedge.runtime.speculative.tree import Draft

_ACCEPT_STREAM = 0x5EC0DE


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted draft nodes (1-based node ids), root excluded
    tokens: list[int]  # accepted draft tokens followed by the bonus token


def uniform(seed: int, position: int, child: int) -> float:
    """A uniform [0, 1) draw keyed on (seed, position, child), independent of the token draws."""
    z = mix_seed(mix_seed(seed ^ _ACCEPT_STREAM, position), child)
    return (z >> 11) / float(1 << 53)


def accept_greedy(target: list[int], draft: Draft) -> Verdict:
    """``target[i]``: the target's argmax after node i."""
    kids = draft.children()
    node, path = 0, []
    while True:
        nxt = next((c for c in kids[node] if draft.tokens[c - 1] == target[node]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return Verdict(path, [draft.tokens[c - 1] for c in path] + [target[node]])


def accept_sampled(probs: torch.Tensor, draft: Draft, seed: int, root_position: int) -> Verdict:
    """``probs``: [len(draft) + 1, vocab] target sampling distributions after each node.
    ``root_position``: position of the root token; the token after node i lands at
    ``root_position + depth(i) + 1``."""
    kids = draft.children()
    depths = draft.depths()
    node, path = 0, []
    while True:
        position = root_position + depths[node] + 1
        p = probs[node].clone()
        chosen = None
        for rank, child in enumerate(kids[node]):
            token = draft.tokens[child - 1]
            total = float(p.sum())
            mass = float(p[token]) / total if total > 0 else 0.0
            if uniform(seed, position, rank) < mass:
                chosen = child
                break
            p[token] = 0.0
        if chosen is None:
            if float(p.sum()) <= 0:  # every token the sampler allows was drafted and rejected
                p = probs[node]
            noise = exponential_noise([mix_seed(seed, position)], p.shape[-1], p.device)
            bonus = int((p / noise[0]).argmax())
            return Verdict(path, [draft.tokens[c - 1] for c in path] + [bonus])
        path.append(chosen)
        node = chosen


def verify(logits: torch.Tensor, seq: Sequence, draft: Draft) -> Verdict:
    """``logits``: [len(draft) + 1, vocab] float32 target logits (already adjusted per request)."""
    if seq.params.greedy:
        return accept_greedy(logits.argmax(dim=-1).tolist(), draft)
    probs = sampling_probs(logits, [seq] * logits.shape[0])
    return accept_sampled(probs, draft, seq.seed, seq.num_tokens - 1)
