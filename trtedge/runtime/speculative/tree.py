"""A draft: tokens proposed after a sequence's last token, as a chain or a token tree.

Node 0 is the root (the sequence's last token, not yet computed by the target); draft token ``j``
is node ``j + 1`` and ``parents[j]`` is its parent node (< j + 1), so nodes are in topological
order and any prefix of the draft is a valid tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtedge.runtime.executor.sampler import to_device


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> Draft:
        return cls(list(tokens), list(range(len(tokens))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == j for j, p in enumerate(self.parents))

    def truncate(self, num_tokens: int) -> Draft:
        return Draft(self.tokens[:num_tokens], self.parents[:num_tokens])

    def first_path(self) -> Draft:
        """The chain of first children from the root (the draft's best guess along one path)."""
        kids = self.children()
        tokens, node = [], 0
        while kids[node]:
            node = kids[node][0]
            tokens.append(self.tokens[node - 1])
        return Draft.chain(tokens)

    def depths(self) -> list[int]:
        """Depth of every node, root included (root 0)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def children(self) -> list[list[int]]:
        """Child nodes of every node, in draft order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, p in enumerate(self.parents):
            kids[p].append(j + 1)
        return kids

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[n + 1, n + 1] bool: node i sees node j iff j is i or an ancestor of i."""
        n = len(self.tokens) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for j, p in enumerate(self.parents):
            mask[j + 1] = mask[p]
            mask[j + 1, j + 1] = True
        return mask.to(device) if device is not None else mask


@dataclass(frozen=True)
class DeviceChains:
    """Linear drafts whose tokens are still on the device: what a proposer may return from ``propose``
    instead of host drafts, so that the target's verify forward is queued right after the draft
    forward and the host reads the drafts and the verdict back together, once. Sequence i's chain is
    ``tokens[rows[i], :lengths[i]]`` (``rows[i]`` None: no draft); every token is an id of the target's
    vocabulary."""

    tokens: torch.Tensor  # [num_rows, max(lengths)] long
    rows: list[int | None]
    lengths: list[int]

    @classmethod
    def from_steps(
        cls,
        steps: list[torch.Tensor],
        chosen: list[list[int]],
        live: list[int],
        num_seqs: int,
        vocab_size: int | None = None,
    ) -> DeviceChains:
        """Chains drafted a step at a time: ``steps[s]`` holds the tokens of step ``s`` for the rows
        ``chosen[s]`` (indices into ``live``, the sequences drafted for; a row drops out once its chain
        is long enough, so each step's rows are a subset of the step's before). ``vocab_size``: the
        target's; a drafted id past it is clamped into it (a draft vocabulary larger than the
        target's: the verify judges whatever token it gets, so the output stays exact)."""
        if all(len(sel) == len(live) for sel in chosen):
            tokens = torch.stack(steps, dim=1)
        else:
            tokens = torch.zeros(len(live), len(steps), dtype=torch.long, device=steps[0].device)
            for s, (sel, step) in enumerate(zip(chosen, steps)):
                tokens[:, s].index_copy_(0, to_device(sel, torch.long, step.device), step)
        if vocab_size is not None:
            tokens.clamp_(max=vocab_size - 1)
        lengths = [0] * len(live)
        for sel in chosen:
            for r in sel:
                lengths[r] += 1
        rows: list[int | None] = [None] * num_seqs
        seq_lengths = [0] * num_seqs
        for r, i in enumerate(live):
            rows[i], seq_lengths[i] = r, lengths[r]
        return cls(tokens, rows, seq_lengths)

    def to_host(self, values: list[int] | None = None) -> list[Draft | None]:
        """The drafts on the host; ``values``: ``tokens`` flattened, already read back."""
        if values is None:
            values = self.tokens.flatten().tolist()
        width = self.tokens.shape[1] if self.tokens.dim() == 2 else 0
        return [
            None if r is None or n <= 0 else Draft.chain(values[r * width : r * width + n])
            for r, n in zip(self.rows, self.lengths)
        ]


def span_mask(prefix_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """[q, prefix_len + q] bool attention mask: every node sees the whole prefix and its ancestors."""
    q = tree_mask.shape[0]
    prefix = torch.ones(q, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask], dim=1)
