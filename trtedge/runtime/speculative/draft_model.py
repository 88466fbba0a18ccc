"""Draft-model proposer: a smaller checkpoint with the target's tokenizer drafts a chain greedily in
its own paged KV cache; after verification only the rows of accepted tokens stay valid."""

from __future__ import annotations

import torch

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.speculative import check_draft
from trtedge.runtime.speculative.draft_cache import DraftCache, Row, last_rows
from trtedge.runtime.speculative.tree import Draft


class DraftModelProposer:
    def __init__(self, draft, target, num_blocks: int, block_size: int):
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
        )

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft | None]:
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
