"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, a free list, and
content-hashed full blocks for context reuse. No tensors here: the runner owns the pool."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from trtedge.runtime.core.hybrid_state import HybridStateCache
from trtedge.runtime.core.partial_blocks import PartialBlockCache
from trtedge.runtime.core.request import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass
class ContextCacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    partial_reused_tokens: int = 0  # of reused_tokens, those taken from partial-block snapshots


def chain_hash(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    h.update(extra)
    return h.digest()


def block_hash(parent: bytes | None, seq: Sequence, index: int, block_size: int) -> bytes:
    """The chained hash of a sequence's block ``index``: its tokens and, for media placeholder tokens,
    the content hashes of the images / videos they stand for (same text, other image: other KV)."""
    start, end = index * block_size, (index + 1) * block_size
    extra = b""
    if seq.mm is not None:
        extra = b"".join(it.hash for it in seq.mm.items if it.offset < end and it.end > start)
    return chain_hash(parent, seq.token_ids[start:end], extra)


def salt_root(salt: str | None) -> bytes | None:
    """The parent hash of a sequence's first block: its cache salt, so that salts never share blocks."""
    if salt is None:
        return None
    return hashlib.blake2b(b"cache-salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_reuse: bool = False
    max_records: int = 1024
    blocks: list[Block] = field(init=False)
    stats: ContextCacheStats = field(default_factory=ContextCacheStats)
    state: HybridStateCache | None = None  # recurrent state slots and snapshots of hybrid models
    partial: PartialBlockCache | None = None  # snapshots of partly filled blocks at prefix ends

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Free blocks in LRU order; a free block may still hold a published record.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self.records: OrderedDict[bytes, int] = OrderedDict()  # hash -> block id, LRU order

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_records(self) -> int:
        return len(self.records)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, seq: Sequence) -> None:
        """On first scheduling: take the longest cached run of full prompt blocks (leaving at least
        one prompt token to compute, so its logits exist)."""
        if not (self.enable_reuse and seq.params.reuse_context) or seq.block_table:
            return
        if seq.params.prompt_logprobs is not None:  # every prompt position is computed to be scored
            return
        self.stats.lookups += 1
        matched: list[int] = []
        hashes = self.prefix_hashes(seq, (seq.num_prompt_tokens - 1) // self.block_size)
        for digest in hashes:
            block_id = self.records.get(digest)
            if block_id is None:
                break
            matched.append(block_id)
        if self.state is not None:  # a recurrent layer resumes only from a snapshot at the prefix end
            while matched and (entry := self.state.find(hashes[len(matched) - 1])) is None:
                matched.pop()
            seq.restore_entry = entry if matched else None
        for digest, block_id in zip(hashes, matched):
            self.records.move_to_end(digest)
            self._take(block_id)
            seq.block_table.append(block_id)
        num_cached = len(seq.block_table) * self.block_size
        if self.partial is not None and not _has_media(seq, num_cached, self.block_size):
            parent = hashes[len(matched) - 1] if matched else salt_root(seq.params.cache_salt)
            end = min(num_cached + self.block_size - 1, seq.num_prompt_tokens - 1)
            found = self.partial.find(parent, seq.token_ids[num_cached:end])
            if found is not None:  # the runner copies the snapshot's rows into the next block
                seq.partial_restore = found
                num_cached += found[1]
                self.stats.partial_reused_tokens += found[1]
        if num_cached:
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            self.stats.hits += 1
            self.stats.reused_tokens += num_cached

    def prefix_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained content hashes of the sequence's first ``num_blocks`` blocks."""
        hashes, parent = [], salt_root(seq.params.cache_salt)
        for i in range(num_blocks):
            parent = block_hash(parent, seq, i, self.block_size)
            hashes.append(parent)
        return hashes

    def share_prompt(self, src: Sequence, dst: Sequence) -> None:
        """Let ``dst`` (same prompt, no blocks yet) reference ``src``'s computed full prompt blocks; the
        partial last block is recomputed by ``dst`` so that no block is ever written by two sequences."""
        if self.state is not None:  # no recurrent state at those block ends: dst looks up or recomputes
            return
        num_full = min(len(src.block_table), (src.num_prompt_tokens - 1) // self.block_size)
        num_full = min(num_full, src.num_computed_tokens // self.block_size)
        for block_id in src.block_table[:num_full]:
            self._take(block_id)
            dst.block_table.append(block_id)
        dst.num_computed_tokens = num_full * self.block_size

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        if self.state is not None and seq.state_slot is None and not self.state.has_free_slot():
            return False
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover ``num_tokens`` tokens (caller checked ``can_grow``)."""
        if self.state is not None and seq.state_slot is None:
            self.state.take_slot(seq)
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            block_id, _ = self.free.popitem(last=False)
            self._forget(block_id)
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll a sequence back to ``num_tokens`` computed tokens (rejected speculative tokens): blocks
        past them go back to the free list; slots past them in the last block are rewritten later."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:  # nothing to reuse in it: hand it out first
                    self.free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        if keep == 0:
            seq.partial_restore = None

    def publish(self, seq: Sequence) -> tuple[int, int, int] | None:
        """Record the sequence's computed full blocks so later requests can reuse them. With a partial
        pool, also give the rows of its last, partly filled block an entry: returns (block id, entry,
        rows) for the runner to copy, or None."""
        if not (self.enable_reuse and seq.params.reuse_context) or self.max_records == 0:
            return None
        limit = min(seq.num_computed_tokens, seq.num_tokens)  # an in-flight sample's id is not known yet
        if seq.params.cache_generated_tokens is False:  # None (unset) caches them
            limit = min(limit, seq.num_prompt_tokens)
        parent = salt_root(seq.params.cache_salt)
        num_full, rows = divmod(limit, self.block_size)
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                digest = block_hash(parent, seq, i, self.block_size)
                if digest in self.records:  # another block holds this content already
                    parent = digest
                    continue
                block.hash = digest
                self.records[block.hash] = block.block_id
                self._trim_records()
            parent = block.hash
        start = num_full * self.block_size
        if self.partial is None or rows == 0 or _has_media(seq, start, self.block_size):
            return None
        entry = self.partial.publish(parent, seq.token_ids[start:limit])
        return None if entry is None else (seq.block_table[num_full], entry, rows)

    def release(self, seq: Sequence) -> None:
        self.truncate(seq, 0)
        if self.state is not None:
            self.state.release(seq)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _forget(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.records.get(block.hash) == block_id:
                del self.records[block.hash]
                self.stats.evictions += 1
            block.hash = None

    def _trim_records(self) -> None:
        while len(self.records) > self.max_records:
            digest, block_id = self.records.popitem(last=False)
            self.blocks[block_id].hash = None
            self.stats.evictions += 1


def _has_media(seq: Sequence, start: int, block_size: int) -> bool:
    """Whether media placeholders fall in the block from ``start`` (partial snapshots skip those)."""
    return seq.mm is not None and any(
        it.offset < start + block_size and it.end > start for it in seq.mm.items
    )
