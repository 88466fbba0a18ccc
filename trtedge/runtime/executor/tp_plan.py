"""A tensor-parallel step's description as one flat int64 tensor: rank 0 packs the flattened batch its
runner built, every other rank unpacks it and runs the same forward. No Python objects per sequence
cross the wire: a step is one broadcast of ``CAPACITY`` integers (a second one carries the rest of a
step larger than that, such as a long prefill chunk).

Layout: a header of ``HEADER`` counts, then the lists back to back:
ids, positions, slots (one each per token), query_lens, context_lens, table lengths (one each per
sequence), the block tables concatenated, last_rows, and the scored rows and their target ids.
Hybrid models add each sequence's state row, checkpoint (tokens, row; 0, -1 for none) and draft
window, and the state-pool operations rank 0 ran since the last step (``StateOp``), which the other
ranks replay before the forward. A decode step that rank 0 runs through its CUDA graphs carries the
rows' sequence ids (the graphs keep block tables per sequence): every rank replays the same graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

CAPACITY = 4096  # int64s in the first broadcast: a decode step of 256 rows with 8-block tables fits


class Message(IntEnum):
    STOP = 0
    STEP = 1
    RUNNER = 2  # the runner's geometry follows (once, at start)


class StateOp(IntEnum):
    """A recurrent-state pool operation outside the forward: (op, its integer arguments)."""

    ZERO = 0  # rows
    COPY = 1  # sources, then as many destinations
    RESTORE = 2  # live row, scratch row


# kind, total length, tokens, sequences, table entries, last rows, scored rows, top count, has score,
# has states, state-op integers, graph step
HEADER = 12


@dataclass(frozen=True)
class StepPlan:
    """One step's flattened batch, as rank 0's runner built it (the arguments of ``ModelRunner.forward``)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    last_rows: list[int]
    score: tuple | None = None  # prompt logprobs: (rows, target ids, top count)
    # hybrid: (state rows, checkpoints [(tokens, row) or None], draft windows), one each per sequence
    states: tuple | None = None
    ops: tuple = ()  # (StateOp, [ints]) to replay before the forward
    seq_ids: list[int] | None = None  # a CUDA-graph decode step: the rows' sequences

    def args(self) -> tuple:
        return (
            self.ids,
            self.positions,
            self.slots,
            self.query_lens,
            self.context_lens,
            self.tables,
            self.last_rows,
            self.score,
        )


def control(kind: Message) -> torch.Tensor:
    """A message without a step (stop, or the announcement of the runner's geometry)."""
    buf = torch.zeros(CAPACITY, dtype=torch.long)
    buf[0], buf[1] = int(kind), HEADER
    return buf


def encode(plan: StepPlan) -> torch.Tensor:
    """The plan as one int64 tensor of at least ``CAPACITY`` entries (zero-padded)."""
    rows, targets, top = plan.score if plan.score is not None else ([], [], 0)
    flat_tables = [b for t in plan.tables for b in t]
    states: list[int] = []
    if plan.states is not None:
        state_rows, checkpoints, windows = plan.states
        states = [
            *state_rows,
            *(c[0] if c is not None else 0 for c in checkpoints),
            *(c[1] if c is not None else -1 for c in checkpoints),
            *windows,
        ]
    ops = [v for op, values in plan.ops for v in (int(op), len(values), *values)]
    body = [
        *plan.ids,
        *plan.positions,
        *plan.slots,
        *plan.query_lens,
        *plan.context_lens,
        *(len(t) for t in plan.tables),
        *flat_tables,
        *plan.last_rows,
        *rows,
        *targets,
        *states,
        *(plan.seq_ids or ()),
        *ops,
    ]
    total = HEADER + len(body)
    header = [
        int(Message.STEP),
        total,
        len(plan.ids),
        len(plan.query_lens),
        len(flat_tables),
        len(plan.last_rows),
        len(rows),
        top,
        int(plan.score is not None),
        int(plan.states is not None),
        len(ops),
        int(plan.seq_ids is not None),
    ]
    buf = torch.zeros(max(total, CAPACITY), dtype=torch.long)
    buf[:total] = torch.tensor(header + body, dtype=torch.long)
    return buf


def decode(buf: torch.Tensor) -> StepPlan:
    """The plan ``encode`` packed (``buf`` holds at least its total length)."""
    values = buf[: int(buf[1])].tolist()
    kind, _, n, seqs, entries, n_last, n_score, top, has_score, has_states, n_ops, graph = values[:HEADER]
    if kind != Message.STEP:
        raise ValueError(f"not a step message: kind {kind}")
    at = HEADER

    def take(count: int) -> list[int]:
        nonlocal at
        part = values[at : at + count]
        at += count
        return part

    ids, positions, slots = take(n), take(n), take(n)
    query_lens, context_lens, lengths = take(seqs), take(seqs), take(seqs)
    flat = take(entries)
    tables, start = [], 0
    for length in lengths:
        tables.append(flat[start : start + length])
        start += length
    last_rows = take(n_last)
    rows, targets = take(n_score), take(n_score)
    score = (rows, targets, top) if has_score else None
    states = None
    if has_states:
        state_rows, ticks, dsts, windows = take(seqs), take(seqs), take(seqs), take(seqs)
        checkpoints = [(t, d) if d >= 0 else None for t, d in zip(ticks, dsts)]
        states = (state_rows, checkpoints, windows)
    seq_ids = take(seqs) if graph else None
    ops, end = [], at + n_ops
    while at < end:
        op, count = take(2)
        ops.append((StateOp(op), take(count)))
    return StepPlan(
        ids, positions, slots, query_lens, context_lens, tables, last_rows, score, states, tuple(ops), seq_ids
    )
