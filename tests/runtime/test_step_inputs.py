"""The decode graphs' staged inputs (``StepInputs``): what the host packs into one copy and the graph
unpacks (``unstage``, captured at the top of each graph) must leave exactly the step's inputs in the
static buffers: the rows' ids with the last step's samples taken where asked, positions, KV slots,
state rows, context lengths and gathered block tables, the padding rows pointing at scratch. Checked
on the CPU against the inputs as given, over random steps, with and without table writes that
overflow the copy."""

from __future__ import annotations

import random

import pytest
import torch

from trtedge.runtime.executor.cuda_graphs import StepInputs
from trtedge.runtime.executor.runner import PendingFill

SCRATCH, BS, PAD_STATE, MAX_BLOCKS = 99, 4, 7, 6
SIZES = [1, 2, 4, 8]


class FewWrites(StepInputs):
    """Room for 2 table writes a step in the copy: most steps overflow into the eager path."""

    @staticmethod
    def writes(size: int) -> int:
        return 2


@pytest.mark.parametrize("cls", [StepInputs, FewWrites])
def test_unstaged_buffers_hold_the_step_inputs_padding_at_scratch(cls):
    rng = random.Random(1)
    io = cls(SIZES, MAX_BLOCKS, BS, SCRATCH, PAD_STATE, torch.device("cpu"))
    tables: dict[int, list[int]] = {}
    for step in range(200):
        for sid in list(tables):
            if rng.random() < 0.15:
                del tables[sid]
        while len(tables) < 1 or (len(tables) < 8 and rng.random() < 0.4):
            tables[1000 + step * 10 + len(tables)] = [rng.randrange(90) for _ in range(rng.randint(1, 3))]
        for t in tables.values():
            if len(t) < MAX_BLOCKS and rng.random() < 0.3:
                t.append(rng.randrange(90))
        seq_ids = list(tables)
        rng.shuffle(seq_ids)
        n = len(seq_ids)
        ids = [rng.randrange(1, 500) for _ in range(n)]
        positions = [rng.randrange(1, 24) for _ in range(n)]
        slots = [rng.randrange(300) for _ in range(n)]
        states = [rng.randrange(5) for _ in range(n)]
        lens = [p + 1 for p in positions]
        samples = torch.tensor([rng.randrange(600, 900) for _ in range(12)])
        taking = sorted(rng.sample(range(n), rng.randint(0, n)))
        src = [rng.randrange(12) for _ in taking]
        fill = PendingFill(taking, src, samples) if taking else None
        step_tables = [list(tables[s]) for s in seq_ids]  # the engine passes slices, not its lists
        size = io.stage(ids, positions, slots, step_tables, lens, fill, seq_ids, states)
        assert size == next(s for s in SIZES if s >= n)
        io.unstage(size)
        want_ids = list(ids)
        for row, j in zip(taking, src):
            want_ids[row] = int(samples[j])
        pad = size - n
        assert io.ids[:size].tolist() == want_ids + [0] * pad
        assert io.positions[:size].tolist() == positions + [0] * pad
        assert io.slots[:size].tolist() == slots + [SCRATCH * BS] * pad
        assert io.state_rows[:size].tolist() == states + [PAD_STATE] * pad
        assert io.context_lens[:size].tolist() == lens + [1] * pad
        got = io.tables[:size].tolist()
        for row, sid in enumerate(seq_ids):
            assert got[row][: len(tables[sid])] == tables[sid]
        for row in range(n, size):
            assert got[row] == [SCRATCH] * MAX_BLOCKS


def test_a_padding_step_reads_scratch_only():
    io = StepInputs(SIZES, MAX_BLOCKS, BS, SCRATCH, PAD_STATE, torch.device("cpu"))
    io.pad(8)
    io.unstage(8)
    assert io.slots[:8].tolist() == [SCRATCH * BS] * 8
    assert io.state_rows[:8].tolist() == [PAD_STATE] * 8
    assert io.tables.unique().tolist() == [SCRATCH]
    assert io.context_lens.tolist() == [1] * 8
