"""Recurrent state of hybrid models on the device: one row per live sequence slot, one per slot's
checkpoint (the state at its last block-aligned prefix end) and one per context-cache snapshot.
The runner owns the pool; the bookkeeping of who holds which row is tensor-free (``snapshots.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RecurrentStatePool:
    """Per linear-attention layer: conv state [rows, K-1, C] (model dtype) and delta-rule state
    [rows, H, Dk, Dv] (float32). Rows: live slots, then their checkpoints, then snapshots."""

    def __init__(self, spec: dict, num_slots: int, num_snapshots: int, device: torch.device):
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        rows = 2 * num_slots + num_snapshots
        layers = spec["num_layers"]
        self.conv = torch.zeros(layers, rows, *spec["conv_shape"], dtype=spec["conv_dtype"], device=device)
        self.ssm = torch.zeros(layers, rows, *spec["ssm_shape"], dtype=torch.float32, device=device)
        self.row_bytes = row_bytes(spec)
        self.device = device

    def checkpoint_row(self, slot: int) -> int:
        return self.num_slots + slot

    def snapshot_row(self, entry: int) -> int:
        return 2 * self.num_slots + entry

    def zero(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.conv.index_fill_(1, index, 0)
        self.ssm.index_fill_(1, index, 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.conv.index_copy_(1, d, self.conv.index_select(1, s))
        self.ssm.index_copy_(1, d, self.ssm.index_select(1, s))

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


def row_bytes(spec: dict) -> int:
    """Bytes of one sequence's whole recurrent state (every linear-attention layer)."""
    conv = spec["num_layers"] * torch.Size(spec["conv_shape"]).numel() * spec["conv_dtype"].itemsize
    return conv + spec["num_layers"] * torch.Size(spec["ssm_shape"]).numel() * 4


@dataclass
class RecurrentBatch:
    """What the linear-attention layers need for one step, sequence by sequence (same order and
    ``query_lens`` as the attention batch): the pool row of each live state and, where the step
    crosses a checkpoint, the number of the sequence's new tokens before it and the row to save to."""

    pool: RecurrentStatePool
    rows: list[int]
    query_lens: list[int]
    checkpoints: list[tuple[int, int] | None]
    rows_tensor: torch.Tensor | None = None  # for decode: gather/scatter all states at once

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)
