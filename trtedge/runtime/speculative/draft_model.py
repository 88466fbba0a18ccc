"""Draft-model proposer: a smaller checkpoint with the target's tokenizer drafts a chain greedily in
its own paged KV cache; after verification only the rows of accepted tokens stay valid. On CUDA the
draft steps replay the draft's own decode CUDA graphs (its catch-up tokens as one decode row each),
each step's tokens feed the next on the device, and the chains stay there (``DeviceChains``): the host
reads them with the verdict."""

from __future__ import annotations

import torch

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.runner import PendingFill
from trtedge.runtime.executor.sampler import to_device
from trtedge.runtime.speculative import check_draft
from trtedge.runtime.speculative.draft_cache import DraftCache, Row, decode_rows, last_rows
from trtedge.runtime.speculative.tree import DeviceChains, Draft


class DraftModelProposer:
    def __init__(
        self,
        draft,
        target,
        num_blocks: int,
        block_size: int,
        graph_rows: int = 0,
        max_blocks: int = 0,
        chain_depth: int = 0,
    ):
        """``graph_rows``: capture the draft's decode CUDA graphs up to that many rows (0: eager; CUDA
        only); ``max_blocks``: blocks a sequence's table may reach; ``chain_depth``: the draft steps
        after the first (num_speculative_tokens - 1), captured as one graph."""
        if draft is None:
            raise ValueError(
                "--speculative-config method draft_model needs model (no draft model was loaded)"
            )
        check_draft(draft.cfg)  # LLM refuses it before loading; an Engine given one directly, here
        cfg = draft.cfg
        self.model = draft
        self.target_vocab = target.cfg.vocab_size
        self.cache = DraftCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            num_blocks,
            block_size,
            getattr(draft, "act_dtype", draft.dtype),
            draft.device,
            scratch=graph_rows > 0,
        )
        self.graphs = None
        if graph_rows > 0:
            from trtedge.runtime.executor.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                draft,
                self.cache.kv_caches,
                graph_rows,
                max_blocks,
                block_size,
                self.cache.scratch_block,
                chain_depth=chain_depth,
            )

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> DeviceChains | list[Draft | None]:
        drafts: list[list[int] | None] = [None] * len(seqs)
        active: list[int] = []
        rows: list[Row] = []
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            st = self.cache.state(seq)
            st.num_computed_tokens = min(st.num_computed_tokens, seq.num_tokens - 1)
            if not self.cache.reserve(st, seq.num_tokens + k - 1):
                continue
            start = st.num_computed_tokens
            rows.append(Row(st, seq.token_ids[start:], list(range(start, seq.num_tokens)), start))
            active.append(i)
            drafts[i] = []
        if rows and self.graphs is not None and self.graphs.fits(sum(len(r.ids) for r in rows)):
            return self._propose_graphs(seqs, limits, rows, active)
        while rows:
            ids, positions, attn = self.cache.attention_batch(rows)
            hidden = self.model.forward(ids, positions, self.cache.kv_caches, attn)
            picks = hidden.index_select(0, torch.tensor(last_rows(rows), device=hidden.device))
            tokens = self.model.logits(picks).argmax(dim=-1).tolist()
            next_rows, next_active = [], []
            for row, i, token in zip(rows, active, tokens):
                row.state.num_computed_tokens = row.storage_start + len(row.ids)
                if token >= self.target_vocab:
                    continue
                drafts[i].append(token)
                if len(drafts[i]) < limits[i]:
                    position = row.state.num_computed_tokens
                    next_rows.append(Row(row.state, [token], [position], position))
                    next_active.append(i)
            rows, active = next_rows, next_active
        return [Draft.chain(d) if d else None for d in drafts]

    def _propose_graphs(self, seqs, limits, rows: list[Row], active: list[int]) -> DeviceChains:
        """The chain through the decode graphs: step 0 runs every row's catch-up tokens (one decode row
        each), step j the token step j - 1 drafted, for the rows whose limit reaches that far."""
        graphs = self.graphs
        ids, positions, slots, tables, context_lens, seq_ids, last = decode_rows(
            rows, [seqs[i].seq_id for i in active], self.cache.block_size
        )
        # row -> its block table (reserved up to the chain's end), one list for all its rows
        whole = {r: tables[end] for r, end in enumerate(last)}
        for row in rows:
            row.state.num_computed_tokens = row.storage_start + len(row.ids)
        logits = graphs.run(ids, positions, slots, tables, context_lens, None, seq_ids)
        picked = to_device(last, torch.long, logits.device)  # (a pageable copy would wait for the step)
        chosen = [list(range(len(rows)))]  # per step: the rows (indices into ``rows``) it drafted for
        tokens = [logits.index_select(0, picked).argmax(dim=-1)]
        depth = graphs.chain_depth
        row_seqs = [seqs[i].seq_id for i in active]
        if depth and all(limits[i] == depth + 1 for i in active):  # the rest of every chain in one graph
            nxt = self._next_rows(chosen[0], rows, whole, row_seqs, depth)
            chain = graphs.run_chain([0] * len(rows), *nxt[:-1], _taking(tokens[0]), nxt[-1])
            tokens += chain.unbind(0)
            chosen += [chosen[0]] * depth
        for step in range(len(chosen), max(limits[i] for i in active)):
            sel = [r for r in chosen[-1] if limits[active[r]] > step]
            if not sel:
                break
            prev = tokens[-1]
            if len(sel) != len(chosen[-1]):
                where = {r: n for n, r in enumerate(chosen[-1])}
                prev = prev.index_select(0, to_device([where[r] for r in sel], torch.long, prev.device))
            nxt = self._next_rows(sel, rows, whole, row_seqs, 1)
            logits = graphs.run([0] * len(sel), *nxt[:-1], _taking(prev), nxt[-1])
            chosen.append(sel)
            tokens.append(logits.argmax(dim=-1))
        # the chains stay on the device (copied out of the graphs' buffers): the verifier reads them
        # back with its verdict
        return DeviceChains.from_steps(tokens, chosen, active, len(seqs), vocab_size=self.target_vocab)

    def _next_rows(self, sel: list[int], rows: list[Row], whole: dict, seq_ids: list[int], steps: int):
        """(positions, slots, tables, context lens, sequence ids) of one decode row for each of ``sel``
        (indices into ``rows``) at its next position; each row's state moves ``steps`` tokens on."""
        bs = self.cache.block_size
        positions, slots, tables, context_lens, ids = [], [], [], [], []
        for r in sel:
            st, table = rows[r].state, whole[r]
            store = st.num_computed_tokens
            positions.append(store)
            slots.append(table[store // bs] * bs + store % bs)
            tables.append(table)
            context_lens.append(store + 1)
            ids.append(seq_ids[r])
            st.num_computed_tokens = store + steps
        return positions, slots, tables, context_lens, ids

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        """Rows hold the sequence's tokens up to the root, then the draft tokens fed back; the accepted
        ones among those stay valid."""
        st = self.cache.states.get(seq.seq_id)
        if st is not None:  # the target has computed root + path by now
            st.num_computed_tokens = min(st.num_computed_tokens, seq.num_computed_tokens)

    def observe(self, seqs, num_tokens, aux) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)


def _taking(tokens: torch.Tensor) -> PendingFill:
    """Row i of a graph step takes ``tokens[i]`` (the last drafted token of each row, on the device)."""
    rows = list(range(tokens.numel()))
    return PendingFill(rows, rows, tokens)
