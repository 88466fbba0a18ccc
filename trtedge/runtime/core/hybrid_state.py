"""Bookkeeping for the recurrent state of hybrid models (no tensors here: the runner owns the pool).

Each running sequence holds a state slot (its live recurrent state plus one checkpoint: the state at
its last block-aligned prefix end). KV blocks alone cannot resume a recurrent layer, so context reuse
also needs a snapshot of the state at the reused prefix end: a sequence publishes its checkpoint into
a bounded LRU pool of snapshots keyed by the prefix's chained block hash, and a lookup reuses the
longest cached prefix that has both its KV blocks and a snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from trtedge.runtime.core.request import Sequence

NO_LIMIT = 1 << 62


@dataclass
class SnapshotStats:
    published: int = 0
    hits: int = 0
    evictions: int = 0


class HybridStateCache:
    def __init__(
        self,
        num_slots: int,
        num_snapshots: int,
        block_size: int,
        thinking_marker_ids=(),
        window: int = 0,
        num_window_rows: int = 0,
    ):
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.window = window  # most tokens of one sequence whose states a step keeps (draft + the one before)
        self.num_window_rows = num_window_rows  # those rows over a whole step
        self.block_size = block_size
        self.marker_ids = frozenset(thinking_marker_ids)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.free_entries = list(range(num_snapshots - 1, -1, -1))
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> snapshot entry, LRU order
        self.stats = SnapshotStats()

    # ---- slots: part of admission -------------------------------------------------------------
    def has_free_slot(self) -> bool:
        return bool(self.free_slots)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def take_slot(self, seq: Sequence) -> None:
        seq.state_slot = self.free_slots.pop()

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
        seq.state_slot = None
        seq.checkpoint_pos = seq.published_pos = 0
        seq.restore_entry = None

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_limit(self, prompt_ids: list[int], reuse: bool, cache_generated: bool) -> int:
        """The furthest position a sequence checkpoints its state at (0: never). A prompt that ends in a
        thinking marker (``<think>`` of a generation prompt) checkpoints before it: the next turn's
        history renders that turn without the marker, so only the text before it is a shared prefix."""
        if not reuse or self.num_snapshots == 0:
            return 0
        tail = range(len(prompt_ids) - 1, max(len(prompt_ids) - 8, -1), -1)
        for i in tail:
            if prompt_ids[i] in self.marker_ids:
                return i
        return NO_LIMIT if cache_generated else len(prompt_ids)

    def checkpoint_target(self, seq: Sequence, num_new: int) -> int:
        """Tokens of this step (of ``num_new`` from ``num_computed_tokens``) after which to save the
        checkpoint: the last block-aligned position the step reaches within the limit, never inside a
        jump-forward draft (its tokens may be rejected); 0 for none. A token sampled by the step in
        flight (asynchronous scheduling) counts, though the host has not read it yet."""
        start = seq.num_computed_tokens
        known = seq.num_tokens + seq.num_inflight - seq.num_draft_tokens
        end = min(start + num_new, seq.checkpoint_limit, known)
        aligned = end - end % self.block_size
        return aligned - start if aligned > start and aligned > seq.checkpoint_pos else 0

    # ---- snapshots ----------------------------------------------------------------------------
    def publish(self, seq: Sequence, prefix_hash: bytes) -> int | None:
        """Give the sequence's checkpoint an entry of the pool (evicting the least recently used);
        returns the entry to copy it into, or None when nothing new is to be copied."""
        seq.published_pos = seq.checkpoint_pos
        if prefix_hash in self.entries:
            self.entries.move_to_end(prefix_hash)
            return None
        if self.free_entries:
            entry = self.free_entries.pop()
        elif self.entries:
            _, entry = self.entries.popitem(last=False)
            self.stats.evictions += 1
        else:
            return None
        self.entries[prefix_hash] = entry
        self.stats.published += 1
        return entry

    def needs_publish(self, seq: Sequence) -> bool:
        return seq.state_slot is not None and seq.checkpoint_pos > seq.published_pos

    def find(self, prefix_hash: bytes) -> int | None:
        entry = self.entries.get(prefix_hash)
        if entry is not None:
            self.entries.move_to_end(prefix_hash)
        return entry

    @property
    def num_entries(self) -> int:
        return len(self.entries)
