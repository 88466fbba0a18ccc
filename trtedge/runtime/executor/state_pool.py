"""Recurrent state of hybrid models on the device: one row per live sequence slot, one per slot's
checkpoint (the state at its last block-aligned prefix end) and one per context-cache snapshot, one
scratch row that the padding rows of a captured decode step update (no sequence owns it), plus the
scratch rows that keep a step's per-position states for draft windows (all allocated at start).
The runner owns the pool; the bookkeeping of who holds which row is tensor-free (``snapshots.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtedge.runtime.executor.sampler import to_device


class RecurrentStatePool:
    """Per linear-attention layer: conv state [rows, K-1, C] (model dtype) and delta-rule state
    [rows, H, Dk, Dv] (float32). Rows: live slots, then their checkpoints, then snapshots, then the
    padding row (``pad_row``)."""

    def __init__(
        self, spec: dict, num_slots: int, num_snapshots: int, device: torch.device, num_window_rows: int = 0
    ):
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        rows = 2 * num_slots + num_snapshots + 1
        self.pad_row = rows - 1
        layers = spec["num_layers"]
        self.conv = torch.zeros(layers, rows, *spec["conv_shape"], dtype=spec["conv_dtype"], device=device)
        self.ssm = torch.zeros(layers, rows, *spec["ssm_shape"], dtype=torch.float32, device=device)
        self.row_bytes = row_bytes(spec)
        self.device = device
        # scratch: the states after each position of a step's draft windows (speculative verification,
        # jump-forward), sized for the largest step the engine can schedule
        self.num_window_rows = num_window_rows
        self.step_conv = self.conv.new_empty(layers, num_window_rows, *spec["conv_shape"])
        self.step_ssm = self.ssm.new_empty(layers, num_window_rows, *spec["ssm_shape"])

    def checkpoint_row(self, slot: int) -> int:
        return self.num_slots + slot

    def snapshot_row(self, entry: int) -> int:
        return 2 * self.num_slots + entry

    def zero(self, rows: list[int]) -> None:
        index = to_device(rows, torch.long, self.device)
        self.conv.index_fill_(1, index, 0)
        self.ssm.index_fill_(1, index, 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        s = to_device(src, torch.long, self.device)
        d = to_device(dst, torch.long, self.device)
        copy_states((self.conv, self.ssm), d, (self.conv, self.ssm), s, dim=1)

    def scratch(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer scratch rows for the states of a step's draft windows (never grown while serving)."""
        if num_rows > self.num_window_rows:
            raise RuntimeError(
                f"internal error: a step's draft windows need {num_rows} recurrent state rows, "
                f"{self.num_window_rows} were allocated"
            )
        return self.step_conv, self.step_ssm

    def save_checkpoints(self, batch: RecurrentBatch) -> None:
        """After a decode step that ran in a CUDA graph: copy the live state of the sequences whose
        step reached a checkpoint (after their one token) into their checkpoint rows; for verify
        chains, the state kept after the checkpoint's token (a scratch row)."""
        if batch.firsts is not None:  # a chain's checkpoint: the scratch row of its ckpt[0]-th token
            source = self.step_conv, self.step_ssm
            pairs = [(f + c[0] - 1, c[1]) for f, c in zip(batch.firsts, batch.checkpoints) if c is not None]
        else:
            source = self.conv, self.ssm
            pairs = [(row, c[1]) for row, c in zip(batch.rows, batch.checkpoints) if c is not None]
        if pairs:
            src = to_device([a for a, _ in pairs], torch.long, self.device)
            dst = to_device([b for _, b in pairs], torch.long, self.device)
            copy_states((self.conv, self.ssm), dst, source, src, dim=1)

    def restore(self, row: int, scratch_row: int) -> None:
        """Load the state saved in ``scratch_row`` of the last step's windows into live ``row``."""
        self.conv[:, row] = self.step_conv[:, scratch_row]
        self.ssm[:, row] = self.step_ssm[:, scratch_row]

    @property
    def nbytes(self) -> int:
        tensors = (self.conv, self.ssm, self.step_conv, self.step_ssm)
        return sum(t.numel() * t.element_size() for t in tensors)


def copy_states(dst: tuple, dst_rows: torch.Tensor, src: tuple, src_rows: torch.Tensor, dim: int = 0) -> None:
    """Copy the (conv, ssm) states at ``src_rows`` of the pair ``src`` to ``dst_rows`` of the pair ``dst``
    (rows along ``dim``; the pairs may be the same tensors)."""
    for d, s in zip(dst, src):
        d.index_copy_(dim, dst_rows, s.index_select(dim, src_rows))


def row_bytes(spec: dict) -> int:
    """Bytes of one sequence's whole recurrent state (every linear-attention layer)."""
    conv = spec["num_layers"] * torch.Size(spec["conv_shape"]).numel() * spec["conv_dtype"].itemsize
    return conv + spec["num_layers"] * torch.Size(spec["ssm_shape"]).numel() * 4


@dataclass
class WindowStep:
    """Step ``j`` of the verification windows: the flat token rows that are the ``j``-th window token of
    their sequence, those sequences' live rows, the scratch rows that keep the state after it, and the
    checkpoints that fall right after it (live rows, checkpoint rows)."""

    index: torch.Tensor
    rows: torch.Tensor
    saves: torch.Tensor
    checkpoints: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class WindowPlan:
    conv: torch.Tensor  # the pool's scratch
    ssm: torch.Tensor
    steps: list[WindowStep]
    firsts: list[int]  # per sequence: its first scratch row


def plan_windows(
    pool: RecurrentStatePool, rows: list[int], query_lens: list[int], checkpoints: list, windows: list[int]
) -> WindowPlan:
    """Speculative verification and jump-forward drafts: the last ``windows[i]`` tokens of sequence i
    run one at a time, and the state after each is kept, so that rejecting a suffix of them can restore
    the state of the accepted prefix (``RecurrentStatePool.restore``)."""
    starts, firsts, offset, total = [], [], 0, 0
    for n, w in zip(query_lens, windows):
        starts.append(offset + n - w)
        firsts.append(total)
        offset += n
        total += w
    conv, ssm = pool.scratch(total)
    device = pool.device

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    steps = []
    for j in range(max(windows)):
        sel = [i for i, w in enumerate(windows) if w > j]
        ckpts = [
            (rows[i], checkpoints[i][1])
            for i in sel
            if checkpoints[i] is not None and checkpoints[i][0] == query_lens[i] - windows[i] + j + 1
        ]
        steps.append(
            WindowStep(
                tensor([starts[i] + j for i in sel]),
                tensor([rows[i] for i in sel]),
                tensor([firsts[i] + j for i in sel]),
                (tensor([a for a, _ in ckpts]), tensor([b for _, b in ckpts])) if ckpts else None,
            )
        )
    return WindowPlan(conv, ssm, steps, firsts)


@dataclass
class Chains:
    """A decode step's rows as chains (a speculative verify step inside the decode graphs): consecutive
    rows of one sequence, each after the one before. The recurrent kernels run a chain in one program,
    from its sequence's live state, and keep the state after each row in the pool's scratch rows.
    ``lens``: [B] the chain's length at its first row, 0 at its other rows (plain decode: all 1);
    ``saves``: [B] the scratch row of each row's state (-1: none); ``conv``, ``ssm``: one layer's
    scratch."""

    lens: torch.Tensor
    saves: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor


def chain_steps(chains: Chains, rows: torch.Tensor):
    """The torch reference's order for a chained step (the fused kernels run each chain in one program):
    per depth j, the step's rows that are the j-th of their chain, their live state rows, and of those
    rows the ones whose state is kept (a mask) with their scratch rows."""
    lens = chains.lens.tolist()
    starts = [b for b, n in enumerate(lens) if n > 0]
    for j in range(max(lens, default=0)):
        index = torch.tensor([b + j for b in starts if lens[b] > j], dtype=torch.long, device=rows.device)
        saves = chains.saves.index_select(0, index)
        keep = saves >= 0
        yield index, rows.index_select(0, index), keep, saves[keep]


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
    windows: list[int] | None = None  # per sequence: trailing tokens verified one by one (0: none)
    plan: WindowPlan | None = None
    # a captured decode step that may take chains (``Chains``): their lengths and scratch rows, [B]
    lens_tensor: torch.Tensor | None = None
    saves_tensor: torch.Tensor | None = None
    firsts: list[int] | None = None  # chains: per sequence, the scratch row of its first token's state

    @property
    def is_decode(self) -> bool:
        return self.plan is None and all(n == 1 for n in self.query_lens)

    def require_eager(self) -> None:
        """Before an eager forward over this batch: the host's view of graphed verify chains
        (``ModelRunner.recurrent_batch(chains=True)``) has no eager plan and would keep no state."""
        if self.firsts is not None:
            raise RuntimeError(
                "internal error: verify chains staged for the decode graphs reached an eager forward"
            )

    def chains(self, layer: int) -> Chains | None:
        """Layer ``layer``'s view of the step's chains; None for a plain decode step."""
        if self.lens_tensor is None:
            return None
        if any(c is not None for c in self.checkpoints):  # copied from the scratch rows after the step
            raise RuntimeError(
                "internal error: a chained step copies its checkpoints after the step, not in it"
            )
        return Chains(
            self.lens_tensor, self.saves_tensor, self.pool.step_conv[layer], self.pool.step_ssm[layer]
        )
