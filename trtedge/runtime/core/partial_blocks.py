"""Snapshots of partly filled KV blocks for context reuse (no tensors here: the runner owns the pool).

Full blocks are reused by their chained content hash, so a prefix that ends inside a block would
lose that block's tokens. At a published prefix end, the rows of its last, partial block are copied
into an entry of a bounded LRU pool, keyed by the hash of the full blocks before it (the parent)
and the tail's tokens. A row's KV depends only on the tokens up to it, so one entry serves every
prefix of its tail too: an entry whose tail a newer one extends is freed, not kept twice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

Key = tuple[bytes | None, tuple[int, ...]]  # (parent hash, tail tokens)


@dataclass
class PartialStats:
    published: int = 0
    hits: int = 0
    evictions: int = 0


class PartialBlockCache:
    def __init__(self, num_entries: int):
        self.num_entries = num_entries
        self.free = list(range(num_entries - 1, -1, -1))
        self.entries: OrderedDict[int, Key] = OrderedDict()  # entry -> its key, LRU order
        self.exact: dict[Key, int] = {}
        self.prefixes: dict[Key, set[int]] = {}  # (parent, tail[:n]) -> entries whose tail starts so
        self.stats = PartialStats()

    @property
    def num_held(self) -> int:
        return len(self.entries)

    def find(self, parent: bytes | None, tokens: list[int]) -> tuple[int, int] | None:
        """The entry holding the longest prefix of ``tokens`` (the tokens after the parent's blocks), and
        how many of its rows that prefix takes; None when no entry starts with ``tokens[0]``."""
        for n in range(len(tokens), 0, -1):
            holders = self.prefixes.get((parent, tuple(tokens[:n])))
            if holders:
                entry = next(iter(holders))
                self.entries.move_to_end(entry)
                self.stats.hits += 1
                return entry, n
        return None

    def publish(self, parent: bytes | None, tail: list[int]) -> int | None:
        """The entry to copy the tail's rows into (evicting the least recently used), or None when an
        entry holds them already."""
        key = (parent, tuple(tail))
        holders = self.prefixes.get(key)
        if holders:
            self.entries.move_to_end(next(iter(holders)))
            return None
        for n in range(1, len(tail)):  # shorter tails this one extends
            covered = self.exact.get((parent, key[1][:n]))
            if covered is not None:
                self._drop(covered)
        if not self.free:
            if not self.entries:
                return None
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        entry = self.free.pop()
        self.entries[entry] = key
        self.exact[key] = entry
        for n in range(1, len(tail) + 1):
            self.prefixes.setdefault((parent, key[1][:n]), set()).add(entry)
        self.stats.published += 1
        return entry

    def _drop(self, entry: int) -> None:
        parent, tail = self.entries.pop(entry)
        del self.exact[(parent, tail)]
        for n in range(1, len(tail) + 1):
            holders = self.prefixes[(parent, tail[:n])]
            holders.discard(entry)
            if not holders:
                del self.prefixes[(parent, tail[:n])]
        self.free.append(entry)
