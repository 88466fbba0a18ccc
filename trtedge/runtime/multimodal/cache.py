"""An LRU cache of encoder outputs keyed by media content hash, bounded in bytes: a repeated image
(the same picture in every turn of a chat, or in many requests) is encoded once."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class EmbeddingCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class EmbeddingCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = EmbeddingCacheStats()
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.stats.evictions += 1
        if value.untyped_storage().nbytes() > size:  # a slice of a batch's output: keep only its own bytes
            value = value.clone()
        self._entries[key] = value
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
