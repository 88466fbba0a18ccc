"""The engine's speculative step: propose drafts for decode rows, score them with the target in one
forward (linear chains causally, token trees under an ancestor mask with per-node positions), accept,
and roll the rejected tokens' KV back (and, for hybrid models, the recurrent state: chains only)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.core.scheduler import ScheduledBatch
from trtedge.runtime.executor.runner import PendingFill
from trtedge.runtime.executor.sampler import to_device
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative.config import SpeculativeConfig
from trtedge.runtime.speculative.tree import DeviceChains, Draft, span_mask
from trtedge.runtime.speculative.verifier import Verdict, accept_greedy, verify

log = logging.getLogger("trtedge")


@dataclass
class SpecStats:
    """Speculative counters of one sequence (or, summed, of the engine)."""

    steps: int = 0  # verification steps
    draft_tokens: int = 0  # draft tokens scored by the target
    accepted_tokens: int = 0  # draft tokens accepted
    emitted_tokens: int = 0  # accepted + bonus tokens
    proposal_time: float = 0.0
    verification_time: float = 0.0

    def add(self, other: SpecStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the bonus token)."""
        return self.emitted_tokens / self.steps if self.steps else 0.0


def may_speculate(p: SamplingParams) -> bool:
    """Requests whose sampler the verifier reproduces exactly (and that did not opt out)."""
    return (
        not p.disable_spec_decode
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
    )


def eligible(seq: Sequence) -> bool:
    """Decode rows of requests that may speculate."""
    return (
        may_speculate(seq.params)
        and seq.num_output_tokens >= 1
        and seq.num_computed_tokens == seq.num_tokens - 1
    )


class SpeculativeDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer,
        runner,
        blocks,
        max_num_batched_tokens: int,
        max_kv_cache_capacity: int,
    ):
        self.config = config
        self.proposer = proposer
        self.runner = runner
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_kv_cache_capacity = max_kv_cache_capacity
        self.stats = SpecStats()
        self.verify_steps = 0  # target forwards that scored drafts
        self.graph_steps = 0  # those that replayed a decode CUDA graph
        # a proposer's device chains feed the verify forward on the device (False: read back first, as
        # host drafts; benchmarks compare the two)
        self.device_drafts = True
        if runner.graphs is not None and not self.graph_verify:
            log.warning(
                "speculative decoding (%s) on a hybrid model (%s) with tensor parallelism verifies its drafts "
                "without CUDA graphs: on CUDA a verify step costs many plain steps (measured ~50x at the "
                "Qwen3.5-0.8B shape), so this is slower than decoding without --speculative-config; per "
                "request, disable_spec_decode turns it off",
                config.method,
                runner.model.cfg.model_type,
            )

    @property
    def graph_verify(self) -> bool:
        """Whether chain verify steps replay the decode CUDA graphs. A hybrid target's graphs must take
        verify chains (its recurrent layers run a chain's nodes one after the other, keeping each
        node's state for the rollback): not with tensor parallelism, whose ranks replay plain steps."""
        graphs = self.runner.graphs
        return graphs is not None and (self.runner.states is None or graphs.verify_chains)

    def _limit(self, seq: Sequence) -> int:
        left = min(
            seq.params.max_tokens - seq.num_output_tokens,
            self.max_kv_cache_capacity - seq.num_tokens,
        )
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def step(self, batch: ScheduledBatch) -> tuple[list[tuple[Sequence, list[int]]], ScheduledBatch]:
        """Verify drafts for the batch's eligible decode rows; return (sequence, new tokens) for them
        and the rows left for the plain path."""
        rows = [s for s, n in zip(batch.seqs, batch.num_tokens) if n == 1 and eligible(s)]
        rows = [s for s in rows if self._limit(s) > 0]
        if not rows:
            return [], batch
        started = time.perf_counter()
        drafts = self.proposer.propose(rows, [self._limit(s) for s in rows])
        chains, chain_rows = None, []  # device chains, and the drafted rows of the kept sequences
        if isinstance(drafts, DeviceChains):
            if self.device_drafts and self.runner.tp is None:
                chains, drafts = drafts, _placeholders(drafts)  # tokens read back with the verdict
            else:  # read now, inside the proposal's time (the other tensor-parallel ranks take host ids)
                drafts = drafts.to_host()
        proposed = time.perf_counter()
        spare = self.max_num_batched_tokens - sum(batch.num_tokens)
        kept: list[tuple[Sequence, Draft]] = []
        for i, (seq, draft) in enumerate(zip(rows, drafts)):
            if draft is None:
                continue
            size = min(len(draft), self.config.verify_tokens, spare, self._slots_left(seq))
            if size <= 0:
                self.proposer.verified(seq, draft, [], None)
                continue
            draft = draft.truncate(size)
            if seq.matcher is not None and not draft.is_chain:  # guides mask a chain node by node
                draft = draft.first_path()
            self.blocks.grow(seq, seq.num_computed_tokens + 1 + size)
            spare -= size
            kept.append((seq, draft))
            if chains is not None:
                chain_rows.append(chains.rows[i])
        if not kept:
            return [], batch
        fill = self._fill(kept, chains, chain_rows) if chains is not None else None
        logits, aux = self._score(kept, fill)
        self.verify_steps += 1
        # one read-back: the device chains' tokens and every plain greedy row's target tokens
        plain = [seq.params.greedy and seq.matcher is None and not seq.params.logit_bias for seq, _ in kept]
        reads = ([fill.tokens] if fill is not None else []) + ([logits.argmax(dim=-1)] if any(plain) else [])
        values = (reads[0] if len(reads) == 1 else torch.cat(reads)).tolist() if reads else []
        if fill is not None:
            drafted, values = values[: fill.tokens.numel()], values[fill.tokens.numel() :]
            kept = _drafts_read(kept, [drafted[j] for j in fill.src])
        argmax = values if any(plain) else None
        results, verdicts = [], []
        offset = 0
        for (seq, draft), simple in zip(kept, plain):
            count = len(draft) + 1
            if simple:
                verdict = accept_greedy(argmax[offset : offset + count], draft)
            else:
                rows_logits = logits[offset : offset + count].float()
                if seq.matcher is not None:
                    rows_logits = _with_guide(rows_logits, seq, draft)
                verdict = verify(_with_bias(rows_logits, seq), seq, draft)
            seq_aux = None
            if aux is not None and draft.is_chain:  # root + accepted nodes: the first rows, a view
                seq_aux = aux[offset : offset + 1 + len(verdict.path)]
            elif aux is not None:
                keep = to_device([offset] + [offset + n for n in verdict.path], torch.long, aux.device)
                seq_aux = aux.index_select(0, keep)
            offset += len(draft) + 1
            self._commit(seq, draft, verdict)
            results.append((seq, verdict.tokens))
            verdicts.append((seq, draft, verdict.path, seq_aux))
        done = time.perf_counter()
        # the proposer's bookkeeping (a head keeps the accepted rows' hidden states) is drafting work:
        # it counts as proposal time, the verify span being the target's forward and the acceptance
        for seq, draft, path, seq_aux in verdicts:
            self.proposer.verified(seq, draft, path, seq_aux)
        kept_time = time.perf_counter() - done
        step = SpecStats(1, 0, 0, 0, proposed - started + kept_time, done - proposed)
        for (seq, draft), (_, tokens) in zip(kept, results):
            mine = SpecStats(
                1, len(draft), len(tokens) - 1, len(tokens), step.proposal_time, step.verification_time
            )
            if seq.spec_stats is None:
                seq.spec_stats = SpecStats()
            seq.spec_stats.add(mine)
            self.stats.add(mine)
        verified = {seq.seq_id for seq, _ in kept}
        rest = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if s.seq_id not in verified]
        return results, ScheduledBatch([s for s, _ in rest], [n for _, n in rest])

    def _slots_left(self, seq: Sequence) -> int:
        """Draft tokens whose KV slots fit in the pool and the request's capacity."""
        start = seq.num_computed_tokens
        free_tokens = (len(seq.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size
        return min(free_tokens, self.max_kv_cache_capacity) - start - 1

    def _fill(
        self, kept: list[tuple[Sequence, Draft]], chains: DeviceChains, chain_rows: list[int]
    ) -> PendingFill:
        """Where the device chains' tokens go among the verify forward's input ids: each kept chain's
        nodes (after its root) take its first ``len(draft)`` tokens, still on the device."""
        width = chains.tokens.shape[1]
        rows, src, offset = [], [], 0
        for (_, draft), row in zip(kept, chain_rows):
            rows += range(offset + 1, offset + 1 + len(draft))
            src += range(row * width, row * width + len(draft))
            offset += len(draft) + 1
        return PendingFill(rows, src, chains.tokens.flatten())

    @torch.inference_mode()
    def _score(
        self, kept: list[tuple[Sequence, Draft]], fill: PendingFill | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over every row's root + draft nodes; logits for every node (float32, or
        through the decode graphs their buffer in the model's dtype, valid until the next replay).
        ``fill``: the draft tokens still on the device, written over the placeholders of ``kept``'s
        drafts."""
        runner = self.runner
        model, bs, device = runner.model, runner.block_size, runner.model.device
        ids, positions, slots, query_lens, context_lens, tables, masks = [], [], [], [], [], [], []
        # Chains run as one decode row per node (row i sees the context up to itself): the fused
        # decode kernels (native CPU, Triton) and the decode CUDA graphs apply; a tree needs its
        # ancestor mask.
        rows_per_node = all(draft.is_chain for _, draft in kept)
        row_tables, row_seqs = [], []  # per node row: the sequence's whole table, for the graphs
        for seq, draft in kept:
            start = seq.num_computed_tokens
            count = len(draft) + 1
            ids.extend([seq.token_ids[start]] + draft.tokens)
            positions.extend(start + d for d in draft.depths())
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + count))
            if rows_per_node:
                whole = table[: -(-(start + count) // bs)]
                row_tables += [whole] * count
                row_seqs += [seq.seq_id] * count
                for end in range(start + 1, start + count + 1):
                    query_lens.append(1)
                    context_lens.append(end)
                    tables.append(table[: -(-end // bs)])
                continue
            query_lens.append(count)
            context_lens.append(start + count)
            tables.append(table[: -(-(start + count) // bs)])
            masks.append(None if draft.is_chain else span_mask(start, draft.ancestor_mask(device)))
        counts = [len(draft) + 1 for _, draft in kept]
        if rows_per_node and self.graph_verify and runner.graph_ready(len(ids)):
            states = None
            if runner.states is not None:  # each chain's recurrent state node by node, inside the graph
                states = runner.recurrent_batch(
                    ScheduledBatch([s for s, _ in kept], counts), counts, chains=True
                )
            # raw: the graph's buffer in the model's dtype (the greedy rows' argmax reads it as it is, the
            # others convert their rows); read before the next replay
            logits = runner.graph_logits(
                ids, positions, slots, row_tables, context_lens, row_seqs, fill, raw=True, states=states
            )
            if logits is None:
                raise RuntimeError("internal error: the decode graphs refused a verify step they fit")
            self.graph_steps += 1
            return logits, getattr(model, "aux_hidden", None)  # MTP's tap: the graphs refresh it
        attn = runner._attention_batch(slots, query_lens, context_lens, tables, decode=rows_per_node)
        if any(m is not None for m in masks):
            # the Triton varlen kernel is causal only: token trees take the torch reference path
            attn.masks, attn.prefill_plan = masks, None
        staged = to_device(ids + positions, torch.long, device)  # one copy, not waiting for the queue
        input_ids, positions = staged[: len(ids)], staged[len(ids) :]
        if fill is not None:
            input_ids.index_copy_(0, *fill.on_device())
        extra = {}
        if runner.states is not None:  # recurrent layers: each chain runs token by token, keeping every state
            extra["states"] = runner.recurrent_batch(ScheduledBatch([s for s, _ in kept], counts), counts)
        hidden = model.forward(
            input_ids,
            positions,
            runner.kv_caches,
            attn,
            **extra,
        )
        return model.logits(hidden), getattr(model, "aux_hidden", None)

    def _commit(self, seq: Sequence, draft: Draft, verdict: Verdict) -> None:
        """Keep the root and the accepted path's KV (moved next to each other for a tree), drop the rest."""
        start = seq.num_computed_tokens
        bs, table = self.runner.block_size, seq.block_table
        moves = [(start + node, start + depth) for depth, node in enumerate(verdict.path, 1) if node != depth]
        if moves:

            def slot(p):
                return table[p // bs] * bs + p % bs

            self.runner.copy_slots([slot(s) for s, _ in moves], [slot(d) for _, d in moves])
        num_computed = start + 1 + len(verdict.path)
        seq.num_computed_tokens = num_computed
        self.blocks.truncate(seq, num_computed)
        seq.num_computed_tokens = self.runner.rollback(seq, num_computed)

    def observe(self, batch: ScheduledBatch) -> None:
        """After a plain forward: proposers that read the target's hidden states (eagle3) take theirs."""
        aux = getattr(self.runner.model, "aux_hidden", None)
        self.proposer.observe(batch.seqs, batch.num_tokens, aux)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)


def _placeholders(chains: DeviceChains) -> list[Draft | None]:
    """Chains of each device chain's length whose tokens are still on the device (zeros meanwhile)."""
    return [
        None if r is None or n <= 0 else Draft.chain([0] * n) for r, n in zip(chains.rows, chains.lengths)
    ]


def _drafts_read(kept: list[tuple[Sequence, Draft]], tokens: list[int]) -> list[tuple[Sequence, Draft]]:
    """``kept`` with its placeholder chains' tokens, read back from the device (in ``_fill``'s order)."""
    out, offset = [], 0
    for seq, draft in kept:
        out.append((seq, Draft.chain(tokens[offset : offset + len(draft)])))
        offset += len(draft)
    return out


def _with_bias(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    bias = seq.params.logit_bias
    if not bias:
        return logits
    logits = logits.clone()
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    logits[:, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def _with_guide(logits: torch.Tensor, seq: Sequence, draft: Draft) -> torch.Tensor:
    """Mask every node's logits with the structured-output guide's state after the draft tokens
    before it; the matcher is rolled back afterwards (the engine accepts the tokens it emits)."""
    from trtedge.runtime.structured import apply_bitmask

    matcher, count = seq.matcher, len(draft) + 1
    bitmask = torch.full((count, -(-logits.shape[-1] // 32)), -1, dtype=torch.int32)
    accepted = 0
    for node in range(count):
        matcher.fill_next_token_bitmask(bitmask, node)
        if node == len(draft) or not matcher.accept_token(draft.tokens[node]):
            break  # later nodes follow a token the guide forbids: the verifier never reaches them
        accepted += 1
        if matcher.is_terminated():
            break
    if accepted:
        matcher.rollback(accepted)
    logits = logits.clone()
    apply_bitmask(logits, bitmask, list(range(count)))
    return logits
