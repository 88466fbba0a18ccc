"""A draft: tokens proposed after a sequence's last token, as a chain or a token tree.

Node 0 is the root (the sequence's last token, not yet computed by the target); draft token ``j``
is node ``j + 1`` and ``parents[j]`` is its parent node (< j + 1), so nodes are in topological
order and any prefix of the draft is a valid tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def span_mask(prefix_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """[q, prefix_len + q] bool attention mask: every node sees the whole prefix and its ancestors."""
    q = tree_mask.shape[0]
    prefix = torch.ones(q, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask], dim=1)
