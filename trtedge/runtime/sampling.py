"""Batched sampling with per-request parameters.

Every sampled row draws its randomness from a generator keyed on (seed, position), so a seeded
request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtedge.runtime.sequence import Sequence

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a counter-based key for one draw."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int]):
        self.eos_token_ids = eos_token_ids

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(seqs), vocab] float32. Returns the chosen token per row and optional logprobs."""
        plain = all(_is_plain(s) for s in seqs)
        if not plain:
            logits = logits.clone()
            for row, seq in enumerate(seqs):
                _adjust(logits[row], seq)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        tokens = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = _sample_row(logits[row], seq)
        infos: list[TokenLogprobs | None] = []
        for row, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None or logprobs_all is None:
                infos.append(None)
                continue
            lp = logprobs_all[row]
            top = []
            if k > 0:
                values, ids = lp.topk(k)
                top = list(zip(ids.tolist(), values.tolist()))
            infos.append(TokenLogprobs(tokens[row], float(lp[tokens[row]]), top))
        return tokens, infos


def _is_plain(seq: Sequence) -> bool:
    p = seq.params
    return (
        not p.logit_bias
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
    )


def _adjust(row: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        ok = ids < row.shape[0]
        row.index_add_(0, ids[ok], torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)[ok])
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_ids, dtype=torch.long).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    scores = logits / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[0]:
        kth = scores.topk(p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    generator = torch.Generator(device=probs.device)
    generator.manual_seed(mix_seed(seq.seed, seq.num_tokens))
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
