"""A proposer's own paged KV cache: a separate block pool (same block size as the target's) and,
per sequence, how many of its tokens the draft has computed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.sampler import to_device
from trtedge.runtime.ops.attention import AttentionBatch
from trtedge.runtime.speculative.tree import DeviceChains


@dataclass
class DraftState:
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # draft KV rows valid for the sequence's real tokens
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)  # proposer-specific (eagle3: pending target hiddens)


@dataclass
class Row:
    """One sequence's query rows in a draft forward: tokens at ``positions`` written to storage
    ``storage_start`` onwards; keys are storage ``[0, storage_start + len(ids))`` under ``mask``."""

    state: DraftState
    ids: list[int]
    positions: list[int]
    storage_start: int
    mask: torch.Tensor | None = None


class DraftCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch: bool = False,
    ):
        """``scratch``: one more block, never handed out, for the writes of CUDA-graph padding rows
        (``scratch_block``)."""
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.device = device
        self.scratch_block = num_blocks
        shape = (num_layers, 2, num_blocks + int(scratch), block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]
        self.states: dict[int, DraftState] = {}

    def state(self, seq: Sequence) -> DraftState:
        st = self.states.get(seq.seq_id)
        if st is None or st.num_preemptions != seq.num_preemptions:  # recomputed target: start over
            if st is not None:
                self.blocks.release(st)
            st = self.states[seq.seq_id] = DraftState(num_preemptions=seq.num_preemptions)
        return st

    def reserve(self, st: DraftState, num_tokens: int) -> bool:
        if not self.blocks.can_grow(st, num_tokens):
            return False
        self.blocks.grow(st, num_tokens)
        return True

    def release(self, seq: Sequence) -> None:
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.release(st)

    def attention_batch(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """(input ids, positions, attention batch) for ``rows``, uploaded in one copy that does not wait
        for the device's queue (a chain's next step is queued while the last one runs)."""
        bs = self.block_size
        ids, positions, slots, query_lens, context_lens, widths, flat_tables = [], [], [], [], [], [], []
        for row in rows:
            table = row.state.block_table
            end = row.storage_start + len(row.ids)
            ids.extend(row.ids)
            positions.extend(row.positions)
            slots.extend(table[p // bs] * bs + p % bs for p in range(row.storage_start, end))
            query_lens.append(len(row.ids))
            context_lens.append(end)
            widths.append(-(-end // bs))
            flat_tables += table[: widths[-1]]
        n = len(ids)
        staged = to_device(ids + positions + slots + flat_tables, torch.long, self.device)
        tables, offset = [], 3 * n
        for width in widths:
            tables.append(staged[offset : offset + width])
            offset += width
        attn = AttentionBatch(
            slot_mapping=staged[2 * n : 3 * n],
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            block_size=bs,
            masks=[row.mask for row in rows] if any(row.mask is not None for row in rows) else None,
        )
        return staged[:n], staged[n : 2 * n], attn


def draft_chains(
    step, cache: DraftCache, states: list[DraftState], ends: list[int], depths: list[int], live: list[int],
    num_seqs: int, tokens: torch.Tensor, hidden: torch.Tensor,
) -> DeviceChains:  # fmt: skip
    """Chains drafted on the device a token at a time, without a read-back: ``tokens`` / ``hidden``
    [len(live), ...], the first step's tokens and hidden states of the sequences ``live`` (indices of
    ``num_seqs``). Row r's sequence has ``ends[r]`` real draft rows (its step s row goes to position and
    storage ``ends[r] - 1 + s``) and drafts ``depths[r]`` tokens. ``step(tokens, hidden, positions,
    attn)``: the next tokens and hidden states."""
    steps, chosen = [tokens], [list(range(len(live)))]
    for s in range(1, max(depths)):
        sel = [r for r in chosen[-1] if depths[r] > s]
        if not sel:
            break
        if len(sel) != len(chosen[-1]):
            where = {r: n for n, r in enumerate(chosen[-1])}
            keep = to_device([where[r] for r in sel], torch.long, tokens.device)
            tokens, hidden = tokens.index_select(0, keep), hidden.index_select(0, keep)
        rows = [Row(states[r], [0], [ends[r] - 1 + s], ends[r] - 1 + s) for r in sel]
        _, positions, attn = cache.attention_batch(rows)
        tokens, hidden = step(tokens, hidden, positions, attn)
        chosen.append(sel)
        steps.append(tokens)
    return DeviceChains.from_steps(steps, chosen, live, num_seqs)


def last_rows(rows: list[Row]) -> list[int]:
    """Flat index of every row's last token."""
    out, end = [], 0
    for row in rows:
        end += len(row.ids)
        out.append(end - 1)
    return out


def decode_rows(rows: list[Row], seq_ids: list[int], block_size: int) -> tuple[list, ...]:
    """``rows`` as a CUDA-graph decode step takes them, every catch-up token one decode row that sees
    storage up to its own: (ids, positions, slots, tables, context lengths, sequence ids) per token,
    and each row's last token's index. A row's tokens share one copy of its block table."""
    ids, positions, slots, tables, context_lens, row_seqs, last = [], [], [], [], [], [], []
    for row, sid in zip(rows, seq_ids):
        table = list(row.state.block_table)
        for j, token in enumerate(row.ids):
            store = row.storage_start + j
            ids.append(token)
            positions.append(row.positions[j])
            slots.append(table[store // block_size] * block_size + store % block_size)
            tables.append(table)
            context_lens.append(store + 1)
            row_seqs.append(sid)
        last.append(len(ids) - 1)
    return ids, positions, slots, tables, context_lens, row_seqs, last


class TargetHiddens:
    """The target's hidden states per position of each sequence, from its forwards (plain steps and
    verification), kept in the draft state until a proposer's catch-up reads them. The rows kept are
    copies: a CUDA-graph step's hidden states are the graph's output buffer, which the next replay
    rewrites (a row may wait several steps for its proposer)."""

    def __init__(self, cache: DraftCache, width: int, dtype: torch.dtype, device: torch.device):
        self.cache = cache
        self.width, self.dtype, self.device = width, dtype, device

    def keep(self, seq: Sequence, start: int, hidden: torch.Tensor | None, count: int) -> None:
        if seq.params.disable_spec_decode:
            return
        st = self.cache.state(seq)
        if hidden is None:
            return
        store = st.extra.setdefault("hidden", {})
        rows = hidden[:count].clone()
        for i in range(count):
            store[start + i] = rows[i]

    def observe(self, seqs: list[Sequence], num_tokens: list[int], hidden: torch.Tensor | None) -> None:
        """After a plain forward: ``hidden`` holds every scheduled token's row, in batch order."""
        offset = 0
        for seq, n in zip(seqs, num_tokens):
            rows = hidden[offset : offset + n] if hidden is not None else None
            self.keep(seq, seq.num_computed_tokens - n, rows, n)
            offset += n

    def verified(self, seq: Sequence, path: list[int], hidden: torch.Tensor | None) -> None:
        """After verification: ``hidden`` holds the root's row and the accepted nodes' rows."""
        if hidden is not None:
            self.keep(seq, seq.num_computed_tokens - 1 - len(path), hidden, len(path) + 1)

    def take(self, st: DraftState, start: int, end: int) -> torch.Tensor:
        """[end - start, width] rows of positions ``start..end - 1``, dropped from the store with every
        earlier one. A position never seen (a reused prefix) reads zeros: the draft is worse, the
        output unchanged."""
        store = st.extra.get("hidden", {})
        zero = None
        out = []
        for p in range(start, end):
            h = store.pop(p, None)
            if h is None:
                if zero is None:
                    zero = torch.zeros(self.width, dtype=self.dtype, device=self.device)
                h = zero
            out.append(h)
        for p in [p for p in store if p < start]:
            del store[p]
        return torch.stack(out)
