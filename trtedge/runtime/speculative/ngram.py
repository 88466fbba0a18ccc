"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's
last n-gram (longest n first). No model; copy-heavy tasks (editing, quoting, code) accept most."""

from __future__ import annotations

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.speculative.tree import Draft


def lookup(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens continuing the most recent earlier match of the last n tokens."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = tokens[size - n :]
        first = tail[0]
        # scan right to left: the latest occurrence is the best predictor of what follows
        for start in range(size - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + num_tokens]
                if follow:
                    return follow
    return []


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft | None]:
        drafts: list[Draft | None] = []
        for seq, k in zip(seqs, limits):
            tokens = lookup(seq.token_ids, k, self.min_n, self.max_n)
            drafts.append(Draft.chain(tokens) if tokens else None)
        return drafts

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        pass

    def observe(self, seqs: list[Sequence], num_tokens: list[int], aux) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
