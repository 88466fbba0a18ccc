"""The decode graphs' device-resident block tables (``BlockTableRows``): after any sequence of steps
(tables growing, a sequence preempted and given new blocks, sequences leaving and new ones taking
their seats, more sequences than seats over time) the gathered rows equal the step's tables, padded
rows read the scratch block only. Checked against the tables built from scratch, on the CPU."""

from __future__ import annotations

import random

import torch

from trtedge.runtime.executor.cuda_graphs import BlockTableRows

SCRATCH = 999


def gathered(rows: BlockTableRows, ids, tables, size):
    seats = rows.seats(ids, tables, size)
    return rows.rows.index_select(0, seats)


def test_rows_follow_growth_replacement_and_new_sequences():
    rng = random.Random(0)
    max_blocks, seats = 8, 6
    rows = BlockTableRows(seats, max_blocks, SCRATCH, torch.device("cpu"))
    tables: dict[int, list[int]] = {}
    next_id = 0
    for step in range(300):
        # sequences finish, new ones come (ids never reused), tables grow, one is preempted now and then
        for sid in list(tables):
            if rng.random() < 0.1:
                del tables[sid]
        while len(tables) < 3 or (len(tables) < seats and rng.random() < 0.3):
            tables[next_id] = [rng.randrange(500) for _ in range(rng.randint(1, 3))]
            next_id += 1
        for sid, t in tables.items():
            if len(t) < max_blocks and rng.random() < 0.3:
                t.append(rng.randrange(500))
            elif rng.random() < 0.05:  # preempted: recomputed into other blocks, maybe shorter
                tables[sid] = [rng.randrange(500) for _ in range(rng.randint(1, len(t)))]
        batch = rng.sample(sorted(tables), rng.randint(1, len(tables)))
        step_tables = [list(tables[sid]) for sid in batch]
        size = len(batch) + rng.randint(0, 2)
        got = gathered(rows, batch, step_tables, size)
        for i, t in enumerate(step_tables):
            assert got[i, : len(t)].tolist() == t, (step, i)
        assert (got[len(batch) :] == SCRATCH).all()
    assert next_id > 2 * seats  # the seats were reused many times over


def test_only_changed_entries_are_written():
    rows = BlockTableRows(4, 8, SCRATCH, torch.device("cpu"))
    gathered(rows, [1, 2], [[5, 6], [7]], 2)
    before = rows.rows.clone()
    rows.rows[:, 4:] = -1  # entries past every table: a full rewrite would not leave them alone
    got = gathered(rows, [2, 1], [[7, 8], [5, 6]], 4)
    assert got[0, :2].tolist() == [7, 8] and got[1, :2].tolist() == [5, 6]
    assert (rows.rows[:, 4:] == -1).all() and (before[:, :2] != rows.rows[:, :2]).sum() == 1


def test_draft_rows_share_a_seat_and_a_cut_back_table_writes_nothing():
    rows = BlockTableRows(4, 8, SCRATCH, torch.device("cpu"))
    # a verify step: three node rows of sequence 1, one of sequence 2 (one seat each)
    seats = rows.seats([1, 1, 1, 2], [[5, 6, 7]] * 3 + [[9]], 6)
    assert seats[:3].tolist() == [seats[0].item()] * 3 and seats[3] != seats[0]
    got = rows.rows.index_select(0, seats)
    assert all(got[i, :3].tolist() == [5, 6, 7] for i in range(3)) and got[3, 0] == 9
    before = rows.rows.clone()
    # rejected drafts: the table is cut back to a prefix, nothing is written
    assert gathered(rows, [1], [[5, 6]], 1)[0, :2].tolist() == [5, 6]
    assert torch.equal(rows.rows, before)
    # it grows again into another block: that entry is written where the cut table ended
    assert gathered(rows, [1], [[5, 6, 8]], 1)[0, :3].tolist() == [5, 6, 8]
