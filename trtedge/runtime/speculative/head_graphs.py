"""A draft head's proposals as CUDA graphs (``draft_top_k`` 1): the linear chains of EAGLE-3 and MTP
heads (``HeadGraphs``) and DFlash's blocks (``BlockGraphs``, one replay a proposal, below).

A chain's proposal is two replays. The first step runs every row a sequence brings (the tokens it has not
drafted over yet, each with the target's hidden state) as one decode row each: row ``p`` writes its key
at storage ``p`` and attends to storage ``[0, p]``, which is the causal catch-up forward, so that it
fits the paged decode kernel and the graphs' static inputs (``StepInputs``, the decode graphs' own
staging: one pinned copy, block tables kept on the device). The chain graph then takes each
sequence's last row and runs the remaining ``depth - 1`` steps, each step's token and hidden state the
next one's input at the next position, the slots computed on the device from the rows' tables. The
tokens stay on the device (``DeviceChains``): the verifier reads them back with its verdict.

With ``capture`` off the same steps run eagerly over the same buffers: the CPU tests' stand-in for
the graphs (``TorchAttention`` reads the tables tensor there)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trtedge.runtime.executor.cuda_graphs import StepInputs, graph_batch_sizes, stage_rows
from trtedge.runtime.ops.attention import AttentionBatch
from trtedge.runtime.speculative.draft_cache import DraftCache, Row, decode_rows
from trtedge.runtime.speculative.tree import DeviceChains

log = logging.getLogger("trtedge")

# step(tokens [n], hidden [n, width], positions [n], attention batch) -> (next tokens [n], hidden)
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class HeadGraphSpec:
    """The geometry of a head's graphs, as ``build_decoder`` sizes them after the target's decode
    graphs: ``depth`` tokens a chain, first steps and chains up to ``max_rows`` rows, draft tables up
    to ``max_blocks`` blocks. ``capture`` off: the same steps eagerly (tests on the CPU)."""

    depth: int
    max_rows: int
    max_blocks: int
    capture: bool = True

    def build(self, step: Step, cache: DraftCache, input_width: int, width: int) -> HeadGraphs:
        return HeadGraphs(
            step,
            cache,
            input_width,
            width,
            self.depth,
            self.max_rows,
            self.max_blocks,
            self.capture,
        )


def _capture_sizes(sizes: list[int], pool, step: Callable[[int], object], prepare=None):
    """``step(size)`` captured per size, largest first, into one memory pool (each after a warm-up
    run; ``prepare(size)`` first stages that size's padding inputs): the graphs, their outputs by
    size, and the pool."""
    graphs, outs = {}, {}
    for size in reversed(sizes):
        if prepare is not None:
            prepare(size)
        step(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        outs[size] = _captured(graph, pool, lambda size=size: step(size))
        pool = graph.pool()
        graphs[size] = graph
    return graphs, outs, pool


class CaptureFailed(RuntimeError):
    """CUDA refused to capture a draft's step (an operation a graph cannot hold)."""


def _captured(graph: torch.cuda.CUDAGraph, pool, step: Callable[[], object]):
    """``step()`` captured into ``graph`` (its warm-up already ran: an error there is a real one and
    propagates); a refused capture raises ``CaptureFailed`` with the cause CUDA gave first."""
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            return step()
    except RuntimeError as e:
        # a capture that ends in an error leaves the capture's side stream current
        torch.cuda.set_stream(stream)
        cause = e.__context__ if isinstance(e.__context__, Exception) else e
        raise CaptureFailed(str(cause).splitlines()[0] if str(cause) else type(cause).__name__) from e


def capture_or_eager(method: str, build: Callable[[], object]):
    """The graphs ``build()`` captures, or None where CUDA refuses to capture them: the proposer then
    drafts eagerly (the output is the same, the drafting slower), and the log says why. Any other
    error (a broken kernel, a dead CUDA context) propagates."""
    try:
        return build()
    except CaptureFailed as e:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a context left broken raises here, not later somewhere else
        log.warning(
            "speculative decoding (%s): the draft's CUDA graphs could not be captured (%s); it drafts "
            "eagerly, which costs more host time a step",
            method,
            e,
        )
        return None


class HeadGraphs:
    def __init__(
        self,
        step: Step,
        cache: DraftCache,
        input_width: int,
        width: int,
        depth: int,
        max_rows: int,
        max_blocks: int,
        capture: bool = True,
    ):
        """``step``: one head step; ``input_width``: the width of the target's hidden rows the first
        step reads (EAGLE-3: three layers' worth), ``width``: the head's own output the chain feeds
        back; ``depth``: tokens a chain drafts; ``max_rows``: the largest first step and chain
        captured; ``max_blocks``: blocks a sequence's draft table may reach. The cache
        needs its scratch block (``DraftCache(scratch=True)``): padding rows write there."""
        device, dtype = cache.device, cache.kv.dtype
        self.step, self.cache, self.depth = step, cache, depth
        self.block_size = cache.block_size
        self.sizes = graph_batch_sizes(max_rows)  # of a first step's rows, and of a chain's
        self.io = StepInputs(self.sizes, max_blocks, cache.block_size, cache.scratch_block, 0, device)
        n = self.sizes[-1]
        self.hidden_in = torch.zeros(n, input_width, dtype=dtype, device=device)
        # the first step's picks and outputs, every row (the chain graph gathers each sequence's last)
        self.picks = torch.zeros(n, dtype=torch.long, device=device)
        self.outs = torch.zeros(n, width, dtype=dtype, device=device)
        # per chain row: its sequence's last first-step row, its step-1 position, its block-table seat,
        # the tokens it keeps (its steps past them write to scratch at position 0: a request near its
        # end must not reach past the rotary tables and the cache it reserved)
        self.chain_in = torch.zeros(4, n, dtype=torch.long, device=device)
        self.capture = capture
        self.first_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.chain_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.chain_out: dict[int, torch.Tensor] = {}  # [depth, size] tokens
        self.num_replays = 0
        if capture:
            self._capture()

    def _capture(self) -> None:
        start = time.perf_counter()
        self.chain_in[1].zero_()
        self.chain_in[2].fill_(self.io.table_rows.pad_seat)
        self.chain_in[3].zero_()
        self.first_graphs, _, pool = _capture_sizes(self.sizes, None, self._first, self.io.pad)
        self.chain_graphs, self.chain_out, _ = _capture_sizes(self.sizes, pool, self._chain)
        torch.cuda.synchronize()
        log.info(
            "captured %d draft-head CUDA graphs (first steps and %d-token chains up to %d rows) in %.1f s",
            len(self.first_graphs) + len(self.chain_graphs),
            self.depth,
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def takes(self, rows: list[Row], depths: list[int]) -> bool:
        """Whether a proposal fits the captured sizes (a prompt's whole catch-up after its prefill
        does not: that one runs eagerly)."""
        return sum(len(row.ids) for row in rows) <= self.sizes[-1] and max(depths) <= self.depth

    def _first(self, size: int) -> None:
        """The first step over ``size`` staged rows; its picks and outputs into ``picks`` / ``outs``."""
        io = self.io
        io.unstage(size)
        attn = AttentionBatch(
            slot_mapping=io.slots[:size],
            query_lens=[1] * size,
            context_lens=[1] * size,
            block_tables=[],
            block_size=self.block_size,
            tables_tensor=io.tables[:size],
            context_lens_tensor=io.context_lens[:size],
        )
        tokens, hidden = self.step(io.ids[:size], self.hidden_in[:size], io.positions[:size], attn)
        self.picks[:size].copy_(tokens)
        self.outs[:size].copy_(hidden)

    def _chain(self, size: int) -> torch.Tensor:
        """Each sequence's chain from its last first-step row: the tokens [depth, size]."""
        last, start, seats, depths = self.chain_in[:, :size]
        tokens, hidden = self.picks.index_select(0, last), self.outs.index_select(0, last)
        tables = self.io.table_rows.rows.index_select(0, seats)
        bs, out = self.block_size, [tokens]
        scratch = self.cache.scratch_block * bs
        for s in range(1, self.depth):
            live = depths > s
            positions = (start + (s - 1)) * live
            block = tables.gather(1, (positions // bs)[:, None])[:, 0].long()
            attn = AttentionBatch(
                slot_mapping=(block * bs + positions % bs).masked_fill(~live, scratch),
                query_lens=[1] * size,
                context_lens=[1] * size,
                block_tables=[],
                block_size=bs,
                tables_tensor=tables,
                context_lens_tensor=(positions + 1).to(torch.int32),
            )
            tokens, hidden = self.step(tokens, hidden, positions, attn)
            out.append(tokens)
        return torch.stack(out)

    def propose(
        self,
        rows: list[Row],
        hiddens: list[torch.Tensor],
        seq_ids: list[int],
        depths: list[int],
        live: list[int],
        num_seqs: int,
    ) -> DeviceChains:
        """Chains for ``rows`` (one a sequence, its catch-up tokens with ``hiddens``, the target's rows
        for them; its draft table reserved ``depths[r] - 1`` rows past them), of which row r drafts
        ``depths[r]`` tokens (at most ``depth``); ``live``: the sequences drafted for, indices of
        ``num_seqs``."""
        ids, positions, slots, tables, context_lens, row_seqs, last = decode_rows(
            rows, seq_ids, self.block_size
        )
        starts = [row.storage_start + len(row.ids) for row in rows]  # each chain's step 1 row
        size = self.io.stage(ids, positions, slots, tables, context_lens, None, row_seqs)
        torch.cat(hiddens, out=self.hidden_in[: len(ids)])
        chain_size = next(s for s in self.sizes if s >= len(rows))
        seats, _ = self.io.table_rows.plan(seq_ids, [tables[i] for i in last], chain_size)
        m = self.chain_in.shape[1]
        staged = stage_rows([(last, 0), (starts, 0), (seats, self.io.table_rows.pad_seat), (depths, 0)], m)
        self.chain_in.copy_(staged, non_blocking=True)
        if self.capture:
            self.first_graphs[size].replay()
            self.chain_graphs[chain_size].replay()
            out = self.chain_out[chain_size]
        else:
            self._first(size)
            out = self._chain(chain_size)
        self.num_replays += 1
        # a copy: the next proposal rewrites the buffer
        tokens = out[:, : len(rows)].t().clone(memory_format=torch.contiguous_format)
        chains_rows: list[int | None] = [None] * num_seqs
        lengths = [0] * num_seqs
        for r, i in enumerate(live):
            chains_rows[i], lengths[i] = r, depths[r]
        return DeviceChains(tokens, chains_rows, lengths)


class BlockGraphs:
    """A block drafter's proposal (DFlash, ``draft_top_k`` 1) as CUDA graphs, one per padded count of
    sequences. Each sequence brings up to ``context_rows`` context rows (the target's tapped states
    since its last proposal; the rest of its share are padding rows writing to scratch) whose keys and
    values every layer writes, and ``block_size`` block rows (its anchor, then masks) that attend as
    decode rows over its context and whole block, staged through ``StepInputs`` as the decode graphs'
    rows are. With ``capture`` off the same forward runs eagerly over the same buffers."""

    def __init__(
        self,
        head,
        cache: DraftCache,
        input_width: int,
        context_rows: int,
        max_seqs: int,
        max_blocks: int,
        capture: bool = True,
    ):
        device = cache.device
        self.head, self.cache, self.context_rows = head, cache, context_rows
        self.block_size, self.rows_per_seq = cache.block_size, head.block_size
        self.seq_sizes = graph_batch_sizes(max_seqs)
        self.io = StepInputs(
            [s * self.rows_per_seq for s in self.seq_sizes],
            max_blocks,
            cache.block_size,
            cache.scratch_block,
            0,
            device,
        )
        m = self.seq_sizes[-1] * context_rows
        # the context rows' slots and positions; where each real row's taps go (m: the spare row)
        self.context_in = torch.zeros(3, m, dtype=torch.long, device=device)
        self.taps_in = torch.zeros(m + 1, input_width, dtype=cache.kv.dtype, device=device)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}  # [size, block_size - 1] tokens
        self.num_replays = 0
        if capture:
            self._capture()

    def _capture(self) -> None:
        start = time.perf_counter()
        self.context_in[0].fill_(self.cache.scratch_block * self.block_size)
        self.context_in[1].zero_()
        self.graphs, self.out, _ = _capture_sizes(
            self.seq_sizes, None, self._draft, lambda size: self.io.pad(size * self.rows_per_seq)
        )
        torch.cuda.synchronize()
        log.info(
            "captured %d draft-block CUDA graphs (up to %d sequences) in %.1f s",
            len(self.graphs),
            self.seq_sizes[-1],
            time.perf_counter() - start,
        )

    def takes(self, catch_up: list[int]) -> bool:
        """Whether a proposal fits: ``catch_up``, each sequence's context rows (a prompt's whole
        context after its prefill does not fit: that one runs eagerly)."""
        return len(catch_up) <= self.seq_sizes[-1] and max(catch_up) <= self.context_rows

    def _draft(self, size: int) -> torch.Tensor:
        head, io = self.head, self.io
        rows, context = size * self.rows_per_seq, size * self.context_rows
        io.unstage(rows)
        slots, positions, _ = self.context_in[:, :context]
        attn = AttentionBatch(
            slot_mapping=torch.cat([slots, io.slots[:rows]]),
            query_lens=[1] * rows,
            context_lens=[1] * rows,
            block_tables=[],
            block_size=self.block_size,
            tables_tensor=io.tables[:rows],
            context_lens_tensor=io.context_lens[:rows],
        )
        logits = head.forward(
            head.features(self.taps_in[:context]),
            io.ids[:rows],
            torch.cat([positions, io.positions[:rows]]),
            self.cache.kv_caches,
            attn,
        )
        return logits.view(size, self.rows_per_seq, -1)[:, 1:].argmax(dim=-1)

    def propose(self, entries: list[tuple], taps: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
        """The block tokens [len(entries), block_size - 1] (a copy) for ``entries``: per sequence
        (its seq id, block table, first context position this proposal writes, its anchor's
        position), ``taps`` its context rows' target states, ``block_ids`` every sequence's block."""
        bs, n_rows, c = self.block_size, self.rows_per_seq, self.context_rows
        positions, slots, tables, lens, row_seqs = [], [], [], [], []
        context_slots, context_positions, dest = [], [], []
        scratch = self.cache.scratch_block * bs
        for j, (sid, table, start, anchor) in enumerate(entries):
            table = list(table)
            end = anchor + n_rows
            for p in range(anchor, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                tables.append(table)
                lens.append(end)
                row_seqs.append(sid)
            real = list(range(start, anchor))
            context_slots += [table[p // bs] * bs + p % bs for p in real] + [scratch] * (c - len(real))
            context_positions += real + [0] * (c - len(real))
            dest += range(j * c, j * c + len(real))
        rows = self.io.stage(block_ids, positions, slots, tables, lens, None, row_seqs)
        size = rows // n_rows
        m = self.context_in.shape[1]
        staged = stage_rows([(context_slots, scratch), (context_positions, 0), (dest, m)], m)
        self.context_in.copy_(staged, non_blocking=True)
        if dest:
            self.taps_in.index_copy_(0, self.context_in[2, : len(dest)], torch.cat(taps))
        if self.capture:
            self.graphs[size].replay()
            out = self.out[size]
        else:
            out = self._draft(size)
        self.num_replays += 1
        return out[: len(entries)].clone()
