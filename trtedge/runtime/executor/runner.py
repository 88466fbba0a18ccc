"""The model runner: owns the model and the KV pool on the device, flattens a scheduled batch
into tensors, runs the forward and samples."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from trtedge.runtime.core.hybrid_state import HybridStateCache
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.core.scheduler import ScheduledBatch
from trtedge.runtime.executor.sampler import Sampler, SampleResult, TokenLogprobs, to_device
from trtedge.runtime.executor.state_pool import RecurrentBatch, RecurrentStatePool, plan_windows
from trtedge.runtime.models.protocol import model_traits
from trtedge.runtime.multimodal.inputs import MediaInputs, media_inputs
from trtedge.runtime.ops import kv_fp8, triton_attention, triton_prefill
from trtedge.runtime.ops.attention import AttentionBatch
from trtedge.runtime.structured import draft_rows

log = logging.getLogger("trtedge")

SCORE_ROWS = 256  # prompt positions scored at once: bounds the [rows, vocab] logits held for prompt logprobs


@dataclass(frozen=True)
class PromptScores:
    """Prompt logprobs computed in a step: those of ``seq``'s prompt tokens ``first``.. (one per entry)."""

    seq: Sequence
    first: int
    logprobs: list[TokenLogprobs]


def kv_block_bytes(model, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block of ``model`` in ``kv_cache_dtype``, all its (full-attention) layers."""
    cfg = model.cfg
    traits = model_traits(model)
    if kv_cache_dtype in kv_fp8.SCALED:  # a byte a value and each row's scale
        row = kv_fp8.row_width(cfg.head_dim)
    else:
        dtype = torch.float16 if kv_cache_dtype == "fp16" else traits.act_dtype
        row = cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return traits.num_kv_layers * 2 * block_size * cfg.num_kv_heads * row


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        sampler: Sampler,
        max_batch_size: int = 1,
        max_blocks_per_seq: int = 1,
        cuda_graphs: bool = True,
        guides=None,
        state: HybridStateCache | None = None,
        mm_embedding_cache_bytes: int = 0,
        num_partial_snapshots: int = 0,
        graph_rows: int | None = None,
        kv_cache_dtype: str = "auto",
        verify_chains: bool = False,
    ):
        """``graph_rows``: the most decode rows a captured step takes (default ``max_batch_size``); a
        speculative verify step scores one row per draft node. ``verify_chains``: speculative decoding
        is on, so a hybrid model's decode graphs also take verify chains (``state_pool.Chains``; not
        with tensor parallelism, whose other ranks replay plain steps only). ``kv_cache_dtype`` fp8 (CUDA) / int8
        (the CPU): the pool in the layout of ``ops.kv_fp8``; fp16: a float16 pool (the CPU)."""
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = sampler
        # Tensor parallel (rank 0): the other ranks build the same runner and run each step's plan.
        traits = model_traits(model)
        self.tp = traits.tp
        if self.tp is not None:  # decode graphs: every rank captures the same ones, collectives inside
            self.tp.send_runner(
                cuda_graphs=cuda_graphs,
                num_blocks=num_blocks,
                block_size=block_size,
                max_batch_size=max_batch_size,
                max_blocks_per_seq=max_blocks_per_seq,
                kv_cache_dtype=kv_cache_dtype,
                state=None
                if state is None
                else (state.num_slots, state.num_snapshots, state.num_window_rows),
            )
        self.guides = guides  # GuidedDecoding: fills token bitmasks of guided rows while the model runs
        # The device decode path (Triton kernels, CUDA graphs) needs CUDA and Triton; without either,
        # every step runs the torch reference path.
        self.on_cuda = model.device.type == "cuda" and triton_attention.available()
        # On CUDA one extra scratch block takes the writes of graph padding rows.
        pool_blocks = num_blocks + 1 if self.on_cuda else num_blocks
        num_kv_layers = traits.num_kv_layers  # hybrid: full-attention layers only
        shape = (num_kv_layers, 2, pool_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        shape = kv_fp8.cache_shape(shape, kv_cache_dtype)
        kv_dtype = torch.uint8 if kv_cache_dtype == "fp8" else traits.act_dtype  # float32 on the CPU
        if kv_cache_dtype == "fp16":  # the CPU (checked at launch): its kernels convert each row
            kv_dtype = torch.float16
        elif kv_cache_dtype == "int8":  # the CPU: int8 values and a float32 scale per row
            kv_dtype = torch.int8
        self.kv = torch.zeros(shape, dtype=kv_dtype, device=model.device)
        self.kv_bytes = self.kv.numel() * self.kv.element_size()
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_kv_layers)]
        # Context reuse: copies of the last, partly filled block of published prefixes (see partial_blocks).
        self.partial_kv_bytes_per_snapshot = kv_block_bytes(model, block_size, kv_cache_dtype)
        self.partial_kv = torch.zeros(
            (*shape[:2], num_partial_snapshots, *shape[3:]), dtype=kv_dtype, device=model.device
        )
        self.state = state
        self.states = None
        self._step_states = None  # this step's RecurrentBatch, for forward()
        self._windows: dict[int, tuple[int, int, int]] = {}  # seq_id -> (first position, scratch row, count)
        if state is not None:
            self.states = RecurrentStatePool(
                model.state_spec(), state.num_slots, state.num_snapshots, model.device, state.num_window_rows
            )
            if self.tp is not None:
                self.tp.watch_states(self.states)
            log.info(
                "recurrent state: %d slots + %d snapshots + %d draft-window rows of %.2f MiB each, %.1f MiB",
                state.num_slots,
                state.num_snapshots,
                state.num_window_rows,
                self.states.row_bytes / 2**20,
                self.states.nbytes / 2**20,
            )
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB",
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.kv_bytes / 2**20,
        )
        vision, audio = traits.vision, traits.audio
        self.media = MediaInputs(vision, mm_embedding_cache_bytes, audio) if vision or audio else None
        # Asynchronous scheduling: the tokens the last step sampled, still on the device, and each
        # sampled sequence's row in them; the next step reads its input ids from there.
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[int, int] = {}
        self._step_parts: list[tuple[list[Sequence], SampleResult]] = []
        if self.on_cuda:  # tensor parallel: every rank warms up alike, so their collectives pair up
            self._warm_up()
        self.graphs = None
        if not traits.graph_safe:  # a step reads its ids on the host (cached PLE pool)
            cuda_graphs = False
        if self.on_cuda and cuda_graphs:
            from trtedge.runtime.executor.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                graph_rows or max_batch_size,
                max_blocks_per_seq,
                block_size,
                num_blocks,
                states=self.states,
                verify_chains=verify_chains and self.tp is None,
            )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile the prefill and eager-decode kernels now rather than inside the first requests: one
        step of each row-count class Triton specialises on (1, a multiple of 16, any other), written
        to the scratch block that the block manager never hands out."""
        scratch, bs = self.num_blocks, self.block_size
        for rows in sorted({1, min(16, bs), max(min(13, bs - 1), 2)}):
            if self.states is not None:  # hybrid: the recurrent layers run on the pool's padding row
                pad = self.states.pad_row
                device = self.model.device
                self._step_states = RecurrentBatch(
                    self.states, [pad], [rows], [None], _to_device([pad], device)
                )
            self.forward(
                [0] * rows,
                list(range(rows)),
                [scratch * bs + i for i in range(rows)],
                [rows],
                [rows],
                [[scratch]],
                [rows - 1],
            )
        self._step_states = None
        torch.cuda.synchronize()

    @torch.inference_mode()
    def prepare_states(self, seqs: list[Sequence]) -> None:
        """Before a step: zero the state of sequences starting from scratch, and load the snapshot of
        those resuming a cached prefix (all at once, before this step publishes anything)."""
        if self.states is None:
            return
        fresh = [s.state_slot for s in seqs if s.num_computed_tokens == 0]
        if fresh:
            self.states.zero(fresh)
        resumed = [s for s in seqs if s.restore_entry is not None]
        if resumed:
            self.states.copy(
                [self.states.snapshot_row(s.restore_entry) for s in resumed], [s.state_slot for s in resumed]
            )
            for s in resumed:
                s.checkpoint_pos = s.published_pos = s.num_computed_tokens
                s.restore_entry = None

    @torch.inference_mode()
    def save_snapshot(self, seq: Sequence, entry: int) -> None:
        """Copy the sequence's checkpoint into snapshot ``entry`` of the pool."""
        self.states.copy([self.states.checkpoint_row(seq.state_slot)], [self.states.snapshot_row(entry)])

    @torch.inference_mode()
    def restore_partial_blocks(self, seqs: list[Sequence]) -> None:
        """Before a step (before it publishes anything): copy the partial-block snapshots that this
        step's context-cache hits reuse into the blocks their prefixes end in, on the device."""
        for seq in seqs:
            if seq.partial_restore is not None:
                entry, rows = seq.partial_restore
                block = seq.block_table[(seq.num_computed_tokens - rows) // self.block_size]
                self.kv[:, :, block, :rows] = self.partial_kv[:, :, entry, :rows]
                seq.partial_restore = None

    @torch.inference_mode()
    def save_partial_block(self, block: int, entry: int, rows: int) -> None:
        """Copy the first ``rows`` rows of KV block ``block`` into partial snapshot ``entry``."""
        self.partial_kv[:, :, entry, :rows] = self.kv[:, :, block, :rows]

    def recurrent_batch(
        self, batch: ScheduledBatch, windows: list[int] | None = None, chains: bool = False
    ) -> RecurrentBatch:
        """The recurrent layers' view of a step (before ``num_computed_tokens`` advances). ``windows``:
        per sequence, the trailing tokens whose every state is kept so that ``rollback`` can return to
        any of them (speculative verification, jump-forward drafts). ``chains``: the windows are whole
        verify chains that the decode graphs run (``graph_logits``): their scratch rows, no eager plan."""
        checkpoints, reached = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            r = self.state.checkpoint_target(seq, n)
            checkpoints.append((r, self.states.checkpoint_row(seq.state_slot)) if r else None)
            reached.append(seq.num_computed_tokens + r if r else seq.checkpoint_pos)
        for seq, pos in zip(batch.seqs, reached):
            seq.checkpoint_pos = pos
        rows = [seq.state_slot for seq in batch.seqs]
        device = self.model.device
        states = RecurrentBatch(
            self.states,
            rows,
            list(batch.num_tokens),
            checkpoints,
            _to_device(rows, device),  # pinned: a plain copy would wait for the step in flight
        )
        windows = windows if windows and any(windows) else [0] * len(rows)
        firsts = [0] * len(rows)
        if chains:
            if windows != states.query_lens:
                raise RuntimeError("internal error: graphed verify chains are whole windows")
            firsts = list(itertools.accumulate(windows, initial=0))[:-1]
            self.states.scratch(sum(windows))  # raises if the step outgrows the scratch rows
            states.firsts = firsts
        elif any(windows):
            states.windows = windows
            states.plan = plan_windows(self.states, rows, states.query_lens, checkpoints, windows)
            firsts = states.plan.firsts
        self._windows = {
            seq.seq_id: (seq.num_computed_tokens + n - w, first, w)
            for seq, n, w, first in zip(batch.seqs, batch.num_tokens, windows, firsts)
        }
        return states

    def _draft_windows(self, batch: ScheduledBatch) -> list[int]:
        """Jump-forward drafts computed whole in this step: the last token before them and the draft."""
        windows = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            k = seq.num_draft_tokens
            whole = 0 < k < n and seq.num_computed_tokens + n == seq.num_tokens
            windows.append(k + 1 if whole else 0)
        return windows

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None], list[PromptScores]]:
        """Compute the scheduled tokens; return the sequences that caught up and their next tokens (a
        sequence with a jump-forward draft repeats once per draft position plus one), and the prompt
        logprobs of the prompt positions computed for sequences that want them. Waits for the device."""
        sampled, result, prompt_scores = self.execute(batch)
        if result is None:
            return [], [], [], prompt_scores
        tokens, infos = result.host()
        return sampled, tokens, infos, prompt_scores

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, keep: bool = False
    ) -> tuple[list[Sequence], SampleResult | None, list[PromptScores]]:
        """Enqueue the step on the device without waiting for it: the sequences that caught up and their
        samples, still on the device. A sequence's last input token may be one the previous step sampled
        and the host has not read yet (``seq.num_inflight``): it is read from the device. ``keep``: the
        samples feed the next step's inputs (``end_step``)."""
        ids: list[int] = []
        fill_rows: list[int] = []
        fill_src: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables = [], [], []
        last_rows: list[int] = []
        sampled: list[Sequence] = []
        scoring: list[tuple[Sequence, int, int]] = []  # (sequence, first prompt token scored, count)
        score_rows: list[int] = []
        score_targets: list[int] = []
        if self.states is not None:
            self._step_states = self.recurrent_batch(batch, self._draft_windows(batch))
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            if seq.prompt_logprobs is not None:
                # position p's logits score prompt token p + 1
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    score_rows.extend(range(len(ids), len(ids) + last - start))
                    score_targets.extend(seq.token_ids[start + 1 : last + 1])
                    scoring.append((seq, start + 1, last - start))
            ids.extend(seq.token_ids[start:end])
            if end > len(seq.token_ids):  # the last step's sample, on the device
                fill_rows.append(len(ids))
                fill_src.append(self._last_rows[seq.seq_id])
                ids.append(0)
            delta = seq.mm.rope_delta if seq.mm is not None else 0  # M-RoPE: generated tokens' offset
            positions.extend(range(start + delta, end + delta))
            table = seq.block_table
            bs = self.block_size
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table[: -(-end // bs)])
            if end >= seq.num_tokens:
                # a jump-forward draft computed in this chunk is verified from the logits of all its positions
                k = seq.num_draft_tokens if seq.num_draft_tokens < n else 0
                last_rows.extend(range(len(ids) - 1 - k, len(ids)))
                sampled.extend([seq] * (k + 1))
        fill = PendingFill(fill_rows, fill_src, self._last_tokens) if fill_rows else None
        embeds = None
        if any(seq.mm is not None for seq in batch.seqs):
            positions, embeds = media_inputs(self.media, batch, positions, self.model.device)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            if seq.mm is not None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.mm_embeds = {}  # the prompt is in the KV cache: its media embeddings are done with
        masks = self.guides.start_masks(sampled) if self.guides is not None and sampled else None
        # a prompt token of a media request has (3, T) M-RoPE positions: the decode graphs take 1D ones
        decode = all(q == 1 for q in query_lens) and not isinstance(positions, torch.Tensor)
        prompt_scores = []
        logits = None
        if decode and not score_rows:
            seq_ids = [seq.seq_id for seq in batch.seqs]
            logits = self.graph_logits(ids, positions, slots, tables, context_lens, seq_ids, fill, raw=True)
        if logits is not None:
            if len(last_rows) != len(ids):  # a one-token prefill chunk short of the prompt's end: no sample
                logits = logits.index_select(0, _to_device(last_rows, logits.device))
        else:
            top = max((s.prompt_logprobs for s, _, _ in scoring), default=0)
            score = (score_rows, score_targets, top) if score_rows else None
            plan = (ids, positions, slots, query_lens, context_lens, tables, last_rows, score)
            if embeds is not None:
                logits, scores = self.forward(*plan, embeds=embeds, fill=fill)
            elif self.tp is None:
                logits, scores = self.forward(*plan, fill=fill)
            else:
                logits, scores = self.tp.step(self.forward, plan, self._step_states)
            offset = 0
            for seq, first, count in scoring:
                prompt_scores.append(PromptScores(seq, first, _trim(scores[offset : offset + count], seq)))
                offset += count
        if not sampled:
            return [], None, prompt_scores
        rows = draft_rows(sampled)
        # the seeded stream's key: the token count at this sample (the host may lag behind by one)
        counts = [r.num_tokens + r.num_inflight for r in rows] if rows is sampled else None
        result = self.sampler.sample(logits, rows, masks, counts)
        if keep:
            self._step_parts.append((sampled, result))
        return sampled, result, prompt_scores

    def graph_ready(self, num_rows: int) -> bool:
        """Whether the decode graphs take a step of ``num_rows`` one-token rows."""
        graphs = self.graphs
        return graphs is not None and self.model.aux_layers == graphs.aux_layers and graphs.fits(num_rows)

    def graph_logits(
        self, ids, positions, slots, tables, context_lens, seq_ids, fill=None, raw: bool = False, states=None
    ) -> torch.Tensor | None:
        """Logits of decode rows (one token each, several rows per sequence allowed: a speculative chain
        scores one row per node) through the decode CUDA graphs; None when the graphs cannot take them.
        ``fill``, ``raw``: as ``DecodeGraphs.run`` (raw logits are the graph's output buffer: read them
        before the next step). ``states``: a hybrid model's verify chains (``recurrent_batch`` with
        ``chains``), one chain of rows per sequence, in order; else the step's own states."""
        if not self.graph_ready(len(ids)):
            return None
        if states is None and self.states is not None:
            states = self._step_states
        if states is not None and states.firsts is None and not states.is_decode:  # draft windows: eager
            return None
        rows, chains = (states.rows if states is not None else None), None
        if states is not None and states.firsts is not None:  # graphs captured without chains refuse them
            rows, lens, saves = [], [], []
            for row, n, first in zip(states.rows, states.query_lens, states.firsts):
                rows += [row] * n
                lens += [n] + [0] * (n - 1)
                saves += range(first, first + n)
            chains = (lens, saves)
        elif self.tp is not None:  # the other ranks replay the same graph
            self.tp.send_graph_step(ids, positions, slots, tables, context_lens, seq_ids, states)
        logits = self.graphs.run(
            ids, positions, slots, tables, context_lens, fill, seq_ids, rows, raw, chains
        )
        if states is not None:
            self.states.save_checkpoints(states)
        return logits

    def end_step(self) -> None:
        """All parts of a step are enqueued: their samples become the next step's device-side inputs."""
        parts, self._step_parts = self._step_parts, []
        if not parts:
            return
        self._last_rows = {}
        offset = 0
        for seqs, _ in parts:
            for i, seq in enumerate(seqs):
                self._last_rows[seq.seq_id] = offset + i
            offset += len(seqs)
        tensors = [result.tokens for _, result in parts]
        self._last_tokens = tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    @torch.inference_mode()
    def forward(
        self,
        ids,
        positions,
        slots,
        query_lens,
        context_lens,
        tables,
        last_rows,
        score=None,
        embeds=None,
        fill=None,
    ) -> tuple[torch.Tensor | None, list[TokenLogprobs]]:
        """The model over a flattened batch: the logits of ``last_rows`` (None when there are none), and
        for ``score`` = (rows, target token ids, top count) the log-softmax of each row's logits at its
        target. The other tensor-parallel ranks run this with the plan rank 0 sent."""
        device = self.model.device
        decode = all(q == 1 for q in query_lens)
        attn = self._attention_batch(slots, query_lens, context_lens, tables, decode)
        input_ids = _to_device(ids, device)
        if fill is not None:
            input_ids.index_copy_(0, *fill.on_device())
        if isinstance(positions, torch.Tensor):  # (3, T) multimodal positions
            pos = positions.to(device)
        else:
            pos = _to_device(positions, device)
        extra = {} if self._step_states is None else {"states": self._step_states}
        if embeds is not None:
            extra["embeds"] = embeds
        hidden = self.model.forward(input_ids, pos, self.kv_caches, attn, **extra)
        scores = self._score(hidden, *score) if score is not None else []
        if not last_rows:
            return None, scores
        rows = _to_device(last_rows, device)
        return self.model.logits(hidden.index_select(0, rows)), scores

    def _score(
        self, hidden: torch.Tensor, rows: list[int], targets: list[int], top: int
    ) -> list[TokenLogprobs]:
        """Each row's logprob of its target token, its rank and the ``top`` most likely tokens, from the
        raw logits (no penalties or temperature), a slice of rows at a time."""
        device = hidden.device
        out: list[TokenLogprobs] = []
        for i in range(0, len(rows), SCORE_ROWS):
            picked = torch.tensor(rows[i : i + SCORE_ROWS], dtype=torch.long, device=device)
            logits = self.model.logits(hidden.index_select(0, picked))
            if self.sampler is None:  # another tensor-parallel rank: rank 0 scores
                continue
            lp = torch.log_softmax(logits, dim=-1)
            wanted = torch.tensor(targets[i : i + SCORE_ROWS], dtype=torch.long, device=device)
            chosen = lp.gather(1, wanted[:, None])
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
            for target, logprob, rank, vs, ts in zip(
                wanted.tolist(), chosen[:, 0].tolist(), ranks, values.tolist(), ids.tolist()
            ):
                out.append(TokenLogprobs(target, logprob, list(zip(ts, vs)), rank))
        return out

    def _attention_batch(self, slots, query_lens, context_lens, tables, decode: bool) -> AttentionBatch:
        device = self.model.device
        if not self.on_cuda:
            return AttentionBatch(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                query_lens=query_lens,
                context_lens=context_lens,
                block_tables=[torch.tensor(t, dtype=torch.long, device=device) for t in tables],
                block_size=self.block_size,
            )
        # One host-to-device copy per tensor, not one per sequence.
        width = max(len(t) for t in tables)
        flat: list[int] = []  # one flat list: torch reads it far faster than a list of lists
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        padded = _to_device(flat, device).view(len(tables), width)
        attn = AttentionBatch(
            slot_mapping=_to_device(slots, device),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=[padded[i, : len(t)] for i, t in enumerate(tables)],
            block_size=self.block_size,
        )
        if decode:
            attn.tables_tensor = padded
            attn.context_lens_tensor = _to_device(context_lens, device)
        elif triton_prefill.supported(self.model.cfg.head_dim):
            tiles, seqs = triton_prefill.plan_tiles(query_lens, context_lens)
            # the sequences' part starts 16-byte aligned, as Triton assumes of a pointer it specialised on
            split = len(tiles) + (-len(tiles)) % 4
            plan = _to_device(tiles + [0] * (split - len(tiles)) + seqs, device, torch.int32)
            attn.prefill_plan = (padded, plan[: len(tiles)].view(-1, 2), plan[split:].view(-1, 3))
        return attn

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy KV of every layer from flat slots ``src`` to ``dst`` (accepted token-tree nodes)."""
        flat = self.kv.view(*self.kv.shape[:2], -1, *self.kv.shape[4:])
        device = self.kv.device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        flat[:, :, torch.tensor(dst, dtype=torch.long, device=device)] = flat[:, :, src_t]

    def rollback(self, seq: Sequence, num_computed: int) -> int:
        """Speculative tokens past ``num_computed`` were rejected. Paged KV needs nothing beyond the
        block-table truncation the caller did; recurrent state returns to what it was after
        ``num_computed`` tokens, from the states its last verification window kept. Returns
        ``num_computed``. A position outside the window is an internal error (the scheduler never
        splits a draft on hybrid models): recomputing instead would rewrite prefix-shared KV blocks."""
        if self.states is None:
            return num_computed
        base, first, count = self._windows.pop(seq.seq_id)  # every sequence of the last step has one
        if num_computed == base + count:
            return num_computed
        if base < num_computed < base + count:
            self.states.restore(seq.state_slot, first + num_computed - base - 1)
            return num_computed
        kept = (
            f"its last step kept states after {base + 1}..{base + count}"
            if count
            else "its last step kept none"
        )
        raise RuntimeError(
            f"internal error: request {seq.request_id} rolls its recurrent state back to {num_computed} "
            f"tokens, but {kept}"
        )


@dataclass
class PendingFill:
    """Input ids still on the device: the last step's samples. Row ``rows[i]`` of the step's ids takes
    ``tokens[src[i]]``; the decode graphs stage ``rows`` and ``src`` with their other inputs."""

    rows: list[int]
    src: list[int]
    tokens: torch.Tensor

    def on_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ids) on the device, for ``index_copy_``."""
        staged = to_device([self.rows, self.src], torch.long, self.tokens.device)
        return staged[0], self.tokens.index_select(0, staged[1])


def _trim(infos: list[TokenLogprobs], seq: Sequence) -> list[TokenLogprobs]:
    """A batch scores every row with the largest top count wanted: keep this sequence's own."""
    k = seq.prompt_logprobs or 0
    for info in infos:
        del info.top[k:]
    return infos


def _to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return to_device(values, dtype, device)
