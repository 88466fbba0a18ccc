"""Decode steps captured as CUDA graphs, one per padded batch size, replayed with the step's
inputs copied into static buffers. Padding rows write to and read from a scratch KV block that
the block manager never hands out and, in hybrid models, the recurrent-state pool's padding row: the
rows' state slots are one more static input, so the conv-state shift and the recurrent update run in
place on the pool inside the graph."""

from __future__ import annotations

import logging
import time

import torch

from trtedge.runtime.executor.sampler import host_tensor, to_device
from trtedge.runtime.executor.state_pool import RecurrentBatch, RecurrentStatePool
from trtedge.runtime.models.protocol import CausalLM
from trtedge.runtime.ops.attention import AttentionBatch

log = logging.getLogger("trtedge")


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


def stage_rows(
    columns: list[tuple[list[int], int]], size: int, tail: list[int] | None = None
) -> torch.Tensor:
    """The step's inputs as one host tensor (pinned on CUDA hosts, so that its copy to the device does
    not wait for the device's queue): each column's values, then its padding value up to ``size``
    ([len(columns), size]; a column given no values is all padding). With ``tail``: flat, the columns
    row after row and then ``tail``."""
    flat: list[int] = []
    for values, pad in columns:
        flat += values
        flat += [pad] * (size - len(values))
    if tail is not None:
        flat += tail
    host = host_tensor(flat, torch.long)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return host if tail is not None else host.view(len(columns), size)


class BlockTableRows:
    """Block tables kept on the device, one row per sequence (a seat), written only where a table
    changed since the last step (a new block every ``block_size`` tokens; all of it after a
    preemption), and gathered into the step's batch order on the device. Building a step's whole
    table on the host from Python lists cost more than the step's kernels at batch 256."""

    def __init__(self, num_seats: int, max_blocks: int, scratch_block: int, device: torch.device):
        self.rows = torch.full((num_seats + 1, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.pad_seat = num_seats  # all scratch: padding rows read it
        self.device = device
        self._seat: dict[int, int] = {}  # seq_id -> seat
        self._written: dict[int, list[int]] = {}  # seq_id -> the table as written there
        self._free = list(range(num_seats - 1, -1, -1))

    def seats(self, seq_ids: list[int], tables: list[list[int]], size: int) -> torch.Tensor:
        """The seats of the step's rows (``size`` with padding) on the device, their rows up to date."""
        seats, update = self.plan(seq_ids, tables, size)
        self.apply(to_device(update, torch.long, self.device))
        return to_device(seats, torch.long, self.device)

    def plan(self, seq_ids: list[int], tables: list[list[int]], size: int) -> tuple[list[int], list[int]]:
        """On the host: the seats of the step's rows (``size`` with padding) and the writes that bring
        their rows up to date, flat (rows, then columns, then values), for ``apply`` on the device."""
        seats, rows, cols, values = [], [], [], []
        for sid, table in zip(seq_ids, tables):
            seat = self._seat.get(sid)
            if seat is None:
                if not self._free:
                    self._evict(set(seq_ids))
                seat = self._seat[sid] = self._free.pop()
                old: list[int] = []
            else:
                old = self._written[sid]
            n, m = len(table), len(old)
            if (old == table) if n == m else (n < m and old[:n] == table):
                # unchanged (one list comparison, no copy: most rows, most steps), or cut back to a
                # prefix after rejected draft tokens: the row's entries past the table are never read
                # before they are written again
                self._written[sid] = table
            else:
                k = m if n > m and table[:m] == old else 0
                rows += [seat] * (len(table) - k)
                cols += range(k, len(table))
                values += table[k:]
                self._written[sid] = table
            seats.append(seat)
        seats += [self.pad_seat] * (size - len(seats))
        return seats, rows + cols + values

    def apply(self, update: torch.Tensor) -> None:
        """The writes ``plan`` listed, on the device ([3 * n] long)."""
        if update.numel():
            update = update.view(3, -1)
            self.rows.index_put_((update[0], update[1]), update[2].to(torch.int32))

    def _evict(self, keep: set[int]) -> None:
        for sid in [s for s in self._seat if s not in keep]:
            self._free.append(self._seat.pop(sid))
            del self._written[sid]
        if not self._free:
            raise RuntimeError("internal error: more sequences in a step than block-table seats")


class StepInputs:
    """A decode graph's static inputs and how a step fills them. The host packs every input of the
    step (ids, positions, KV slots, state rows, context lengths, block-table seats, where the last
    step's samples go, and the block-table writes) into one pinned buffer, copied to the device in one
    copy; the graph itself unpacks it (``unstage``, captured at the top of each graph), so that a step
    costs the host one copy and the replay rather than a launch per input. Padding rows and unused
    writes point at scratch: the scratch KV block, the state pool's padding row, the all-scratch
    padding seat, one spare id slot past the largest size. ``chains``: a hybrid model's steps also take
    the rows' chain lengths and scratch state rows (``state_pool.Chains``: speculative verify steps)."""

    def __init__(self, sizes, max_blocks, block_size, scratch_block, pad_state, device, chains: bool = False):
        n = sizes[-1]
        self.sizes, self.block_size = sizes, block_size
        self.scratch_block, self.pad_state = scratch_block, pad_state
        self.columns = _COLUMNS + (_CHAIN_COLUMNS if chains else ())
        # chains: each row's chain length (1: a plain decode row) and the scratch row of its state (-1: none)
        self.state_lens = torch.ones(n, dtype=torch.long, device=device) if chains else None
        self.state_saves = torch.full((n,), -1, dtype=torch.long, device=device) if chains else None
        # ids, positions, KV slots and state rows ([4, n + 1]: the last column is the spare slot that
        # padding rows of the samples' fill write to)
        self.inputs = torch.zeros(4, n + 1, dtype=torch.long, device=device)
        self.ids, self.positions, self.slots, self.state_rows = self.inputs.unbind(0)
        self.slots.fill_(scratch_block * block_size)
        self.state_rows.fill_(pad_state)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.table_rows = BlockTableRows(2 * n, max_blocks, scratch_block, device)
        self.fill_values = torch.zeros(n, dtype=torch.long, device=device)  # the samples a step takes
        self.staged = torch.zeros(max(self._span(s) for s in sizes), dtype=torch.long, device=device)

    @staticmethod
    def writes(size: int) -> int:
        """Block-table writes a ``size`` step carries in its copy (more are applied before the replay):
        a row crosses into a new block every ``block_size`` tokens, a new sequence brings its table."""
        return 2 * size + 256

    def _span(self, size: int) -> int:
        return len(self.columns) * size + 3 * self.writes(size)

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        columns = len(self.columns) * size
        rows = self.staged[:columns].view(len(self.columns), size)
        return rows, self.staged[columns : self._span(size)].view(3, self.writes(size))

    def pad(self, size: int) -> None:
        """Staged inputs of a step of padding rows only (the warm-up before a capture)."""
        self.staged[: self._span(size)].copy_(self._pack([], [], [], [], [], [], [], [], [], size))

    def stage(
        self, ids, positions, slots, tables, context_lens, fill, seq_ids, state_rows=None, chains=None
    ) -> int:
        """Copy a step's inputs to the device (one copy; the samples' gather and overflowing table
        writes apart); the padded size whose graph takes them. ``chains``: (lengths, scratch rows) of
        a verify step's rows (``state_pool.Chains``), else every row is a plain decode row."""
        size = next(s for s in self.sizes if s >= len(ids))
        seats, update = self.table_rows.plan(seq_ids, tables, size)
        fill_rows, fill_src = (fill.rows, fill.src) if fill is not None else ([], [])
        overflow = len(update) > 3 * self.writes(size)
        packed = self._pack(
            ids,
            positions,
            slots,
            state_rows or [],
            context_lens,
            seats,
            fill_rows,
            fill_src,
            [] if overflow else update,
            size,
            chains,
        )
        self.staged[: packed.numel()].copy_(packed, non_blocking=True)
        if overflow:  # many new tables at once (the first decode step of a wave of prompts)
            self.table_rows.apply(to_device(update, torch.long, self.staged.device))
        if fill_rows:
            rows, _ = self._views(size)
            src = rows[_COLUMNS.index("fill_src"), : len(fill_rows)]
            out = self.fill_values[: len(fill_rows)]
            if fill.tokens.dtype == out.dtype:
                torch.index_select(fill.tokens, 0, src, out=out)
            else:
                out.copy_(fill.tokens.index_select(0, src))
        return size

    def _pack(
        self,
        ids,
        positions,
        slots,
        state_rows,
        context_lens,
        seats,
        fill_rows,
        fill_src,
        update,
        size,
        chains=None,
    ):
        writes = self.writes(size)
        k = len(update) // 3
        pads = writes - k
        tail = update[:k] + [self.table_rows.pad_seat] * pads  # row: the padding seat, all scratch
        tail += update[k : 2 * k] + [0] * pads
        tail += update[2 * k :] + [self.scratch_block] * pads
        spare = len(self.ids) - 1
        columns = [
            (ids, 0),
            (positions, 0),
            (slots, self.scratch_block * self.block_size),
            (state_rows, self.pad_state),
            (context_lens, 1),
            (seats, self.table_rows.pad_seat),
            (fill_rows, spare),
            (fill_src, 0),
        ]
        if self.state_lens is not None:
            lens, saves = chains if chains is not None else ([], [])
            columns += [(lens, 1), (saves, -1)]
        elif chains is not None:
            raise RuntimeError("internal error: a chained step staged for graphs captured without chains")
        return stage_rows(columns, size, tail)

    def recurrent_batch(self, pool: RecurrentStatePool, size: int) -> RecurrentBatch:
        """The recurrent layers' view of a ``size`` step over these buffers: each row's state row and,
        with chains, its chain length and scratch row. Checkpoints are copied after the replay
        (``RecurrentStatePool.save_checkpoints``)."""
        batch = RecurrentBatch(pool, [], [1] * size, [None] * size, rows_tensor=self.state_rows[:size])
        if self.state_lens is not None:
            batch.lens_tensor, batch.saves_tensor = self.state_lens[:size], self.state_saves[:size]
        return batch

    def unstage(self, size: int) -> None:
        """On the device (inside the graph): the staged copy into the step's static inputs."""
        rows, writes = self._views(size)
        self.inputs[:, :size].copy_(rows[:4])
        self.context_lens[:size].copy_(rows[4])
        self.table_rows.apply(writes.flatten())
        torch.index_select(self.table_rows.rows, 0, rows[5], out=self.tables[:size])
        self.ids.index_copy_(0, rows[_COLUMNS.index("fill_rows")], self.fill_values[:size])
        if self.state_lens is not None:
            self.state_lens[:size].copy_(rows[len(_COLUMNS)])
            self.state_saves[:size].copy_(rows[len(_COLUMNS) + 1])


# the staged rows of a step, in order (StepInputs._pack); the first four are StepInputs.inputs; with
# chains, then _CHAIN_COLUMNS
_COLUMNS = ("ids", "positions", "slots", "state_rows", "context_lens", "seats", "fill_rows", "fill_src")
_CHAIN_COLUMNS = ("state_lens", "state_saves")


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches,
        max_batch_size: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        chain_depth: int = 0,
        states: RecurrentStatePool | None = None,
        verify_chains: bool = False,
    ):
        """``chain_depth``: also capture, per size, that many decode steps in one graph, each row's
        argmax its next input (a draft model's chain, ``run_chain``). ``states``: a hybrid model's
        recurrent-state pool, whose rows the steps read and update (one row per sequence).
        ``verify_chains`` (with ``states``): the steps also take speculative verify chains, several
        rows of one sequence whose recurrent layers run one after the other (``state_pool.Chains``)."""
        device = model.device
        self.model = model
        self.states = states
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = graph_batch_sizes(max_batch_size)
        self.pad_state = states.pad_row if states is not None else 0
        self.verify_chains = verify_chains and states is not None
        # the step's static inputs, filled by one host-to-device copy a step and unpacked inside the graph
        self.io = StepInputs(
            self.sizes, max_blocks, block_size, scratch_block, self.pad_state, device, self.verify_chains
        )
        io = self.io
        self.ids, self.positions, self.slots, self.state_rows = io.ids, io.positions, io.slots, io.state_rows
        self.tables, self.context_lens, self.table_rows = io.tables, io.context_lens, io.table_rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # the final hidden states (MTP drafting reads them)
        self.num_replays = 0
        self.chain_depth = chain_depth
        self._capture(kv_caches)

    def recapture(self) -> None:
        """Capture again (a proposer changed what the steps keep: ``model.aux_layers``, the hidden
        states an EAGLE-3 head or DFlash draft reads), the old graphs' memory released first."""
        self.graphs.clear()
        self.chains.clear()
        self.logits, self.hidden, self.aux, self.chain_tokens = {}, {}, {}, {}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._capture(self.kv_caches)

    def _capture(self, kv_caches) -> None:
        chain_depth, states = self.chain_depth, self.states
        self.kv_caches = kv_caches
        self.aux_layers = tuple(self.model.aux_layers)  # the taps these graphs keep (aux)
        self.aux: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self.io.pad(size)  # warm-up on padding rows: compiles kernels, settles allocations
            self.io.unstage(size)
            self._step(size, kv_caches)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.io.unstage(size)
                self.logits[size] = self._step(size, kv_caches)
            pool = graph.pool()
            self.graphs[size] = graph
            if self.aux_layers:
                self.aux[size] = self.model.aux_hidden
        self.chains: dict[int, torch.cuda.CUDAGraph] = {}
        self.chain_tokens: dict[int, torch.Tensor] = {}
        for size in reversed(self.sizes) if chain_depth and states is None else ():
            self.io.pad(size)
            self.io.unstage(size)
            self._chain(size, kv_caches)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.io.unstage(size)
                self.chain_tokens[size] = self._chain(size, kv_caches)
            pool = graph.pool()
            self.chains[size] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch %s%s) in %.1f s",
            len(self.sizes) + len(self.chains),
            self.sizes,
            f"; and {chain_depth}-step chains" if chain_depth else "",
            time.perf_counter() - start,
        )

    def _step(self, size: int, kv_caches) -> torch.Tensor:
        extra = {} if self.states is None else {"states": self.io.recurrent_batch(self.states, size)}
        hidden = self.model.forward(
            self.ids[:size], self.positions[:size], kv_caches, self._batch(size), **extra
        )
        self.hidden[size] = hidden
        # in the model's dtype where it has no float-only step (softcap): the sampler's race reads them
        # as they are, and ``run`` converts them for the other readers
        return getattr(self.model, "decode_logits", self.model.logits)(hidden)

    def _chain(self, size: int, kv_caches) -> torch.Tensor:
        """``chain_depth`` decode steps, each row's argmax the next step's input at the next position
        (its KV slot from the row's block table on the device): the tokens, [chain_depth, size]."""
        bs, out = self.block_size, []
        for step in range(self.chain_depth):
            token = self._step(size, kv_caches).argmax(dim=-1)
            out.append(token)
            if step + 1 < self.chain_depth:
                self.ids[:size].copy_(token)
                self.positions[:size].add_(1)
                self.context_lens[:size].add_(1)
                store = self.context_lens[:size].long() - 1
                block = self.tables[:size].gather(1, (store // bs)[:, None])[:, 0].long()
                self.slots[:size].copy_(block * bs + store % bs)
        return torch.stack(out)

    def _batch(self, size: int) -> AttentionBatch:
        return AttentionBatch(
            slot_mapping=self.slots[:size],
            query_lens=[1] * size,
            context_lens=[1] * size,
            block_tables=[],
            block_size=self.block_size,
            tables_tensor=self.tables[:size],
            context_lens_tensor=self.context_lens[:size],
        )

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        context_lens: list[int],
        fill,
        seq_ids: list[int],
        state_rows: list[int] | None = None,
        raw: bool = False,
        chains: tuple[list[int], list[int]] | None = None,
    ) -> torch.Tensor:
        """Logits [len(ids), vocab] for one decode token per row. ``fill``: input ids still on the
        device (the last step's samples), written over the placeholders of ``ids``: a
        ``runner.PendingFill`` (its host lists go with the step's other inputs).
        ``seq_ids``: the rows' sequences, whose block tables stay on the device between steps.
        ``state_rows``: with a state pool, each row's live state row (one row per sequence). ``raw``:
        the graph's buffer as it is (the model's dtype, bf16 say; read it before the next step), else
        float32. ``chains``: (lengths, scratch rows) of a verify step's rows (``StepInputs.stage``)."""
        size = self._stage(ids, positions, slots, tables, context_lens, fill, seq_ids, state_rows, chains)
        self.graphs[size].replay()
        self.num_replays += 1
        if getattr(self.model, "keep_hidden", False):
            self.model.aux_hidden = self.hidden[size][: len(ids)]
        if self.aux_layers:
            self.model.aux_hidden = self.aux[size][: len(ids)]
        logits = self.logits[size][: len(ids)]
        return logits if raw else logits.float()

    def run_chain(self, ids, positions, slots, tables, context_lens, fill, seq_ids) -> torch.Tensor:
        """``chain_depth`` greedy decode steps from the rows given (as ``run`` takes them), each step's
        argmax the next one's input: the tokens [chain_depth, len(ids)], in the graph's buffer. Every
        row's block table must reach ``chain_depth`` tokens past its position."""
        size = self._stage(ids, positions, slots, tables, context_lens, fill, seq_ids)
        self.chains[size].replay()
        return self.chain_tokens[size][:, : len(ids)]

    def _stage(
        self, ids, positions, slots, tables, context_lens, fill, seq_ids, state_rows=None, chains=None
    ) -> int:
        """The step's inputs into the static buffers (the graph unpacks them); the padded size whose
        graph takes them."""
        if (self.states is None) != (state_rows is None):
            raise RuntimeError(
                "internal error: state rows are given exactly when the graphs hold a state pool"
            )
        return self.io.stage(ids, positions, slots, tables, context_lens, fill, seq_ids, state_rows, chains)
