"""The index and padding logic of decode CUDA graphs over recurrent layers, on the CPU: the staged
inputs pad every column with its own value, padding rows own the pool's padding row (no slot,
checkpoint, snapshot or draft-window row), and checkpoints of a graphed step are copied afterwards."""

from __future__ import annotations

import pytest
import torch

from trtedge.runtime.executor.cuda_graphs import stage_rows
from trtedge.runtime.executor.state_pool import RecurrentBatch, RecurrentStatePool

SPEC = {"num_layers": 2, "conv_shape": (3, 4), "conv_dtype": torch.float32, "ssm_shape": (2, 3, 3)}


def test_staged_columns_pad_with_their_own_value_up_to_the_graph_size():
    staged = stage_rows([([5, 6], 0), ([7, 8], 99), ([], 41)], 4)
    assert staged.tolist() == [[5, 6, 0, 0], [7, 8, 99, 99], [41, 41, 41, 41]]


def test_the_padding_row_is_no_slot_checkpoint_or_snapshot_row():
    pool = RecurrentStatePool(
        SPEC, num_slots=3, num_snapshots=2, device=torch.device("cpu"), num_window_rows=4
    )
    owned = (
        set(range(3)) | {pool.checkpoint_row(s) for s in range(3)} | {pool.snapshot_row(e) for e in range(2)}
    )
    assert pool.pad_row not in owned
    assert pool.pad_row == pool.conv.shape[1] - 1 == pool.ssm.shape[1] - 1
    assert pool.step_conv.shape[1] == 4  # draft-window scratch rows live apart


def test_checkpoints_of_a_graphed_step_copy_the_live_rows_after_it():
    pool = RecurrentStatePool(SPEC, num_slots=3, num_snapshots=0, device=torch.device("cpu"))
    pool.conv.normal_()
    pool.ssm.normal_()
    before = pool.conv.clone(), pool.ssm.clone()
    batch = RecurrentBatch(pool, [2, 0], [1, 1], [(1, pool.checkpoint_row(2)), None])
    pool.save_checkpoints(batch)
    for state, old in zip((pool.conv, pool.ssm), before):
        assert torch.equal(state[:, pool.checkpoint_row(2)], old[:, 2])
        assert torch.equal(state[:, pool.checkpoint_row(0)], old[:, pool.checkpoint_row(0)])  # none asked
        assert torch.equal(state[:, :3], old[:, :3])


def test_checkpoints_of_a_graphed_verify_chain_copy_the_state_kept_after_their_token():
    """A verify chain's checkpoint falls after its first token (the root, always accepted): after the
    replay the live row holds the state after the whole chain, the scratch row the one to save."""
    pool = RecurrentStatePool(
        SPEC, num_slots=3, num_snapshots=0, device=torch.device("cpu"), num_window_rows=8
    )
    for t in (pool.conv, pool.ssm, pool.step_conv, pool.step_ssm):
        t.normal_()
    before = [t.clone() for t in (pool.conv, pool.ssm, pool.step_conv, pool.step_ssm)]
    batch = RecurrentBatch(
        pool, [2, 0], [3, 4], [None, (1, pool.checkpoint_row(0))], windows=[3, 4], firsts=[0, 3]
    )
    pool.save_checkpoints(batch)
    for state, old, kept in zip((pool.conv, pool.ssm), before[:2], before[2:]):
        assert torch.equal(state[:, pool.checkpoint_row(0)], kept[:, 3])  # the second chain's first row
        assert torch.equal(state[:, pool.checkpoint_row(2)], old[:, pool.checkpoint_row(2)])
        assert torch.equal(state[:, :3], old[:, :3])


def test_verify_chain_columns_stage_and_pad_as_plain_decode_rows():
    from trtedge.runtime.executor.cuda_graphs import StepInputs

    io = StepInputs([1, 2, 4, 8], 4, 4, 99, 7, torch.device("cpu"), chains=True)
    size = io.stage(
        [5, 6, 7],
        [3, 4, 5],
        [1, 2, 3],
        [[0], [0], [0]],
        [4, 5, 6],
        None,
        [1, 1, 1],
        [2, 2, 2],
        ([3, 0, 0], [0, 1, 2]),
    )
    io.unstage(size)
    assert size == 4
    assert io.state_lens[:4].tolist() == [3, 0, 0, 1] and io.state_saves[:4].tolist() == [0, 1, 2, -1]
    size = io.stage([5], [3], [1], [[0]], [4], None, [1], [2])  # a plain decode step: chains of one
    io.unstage(size)
    assert io.state_lens[:1].tolist() == [1] and io.state_saves[:1].tolist() == [-1]
    plain = StepInputs([1, 2, 4, 8], 4, 4, 99, 7, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="captured without chains"):
        plain.stage([5], [3], [1], [[0]], [4], None, [1], [2], ([1], [0]))
