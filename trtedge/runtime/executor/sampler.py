"""Batched sampling with per-request parameters.

Every sampled row draws its randomness from a generator keyed on (seed, position), so a seeded
request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtedge.runtime.core.request import Sequence

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
    rank: int | None = None  # 1 + the number of tokens more likely (prompt logprobs)


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int]):
        self.eos_token_ids = eos_token_ids

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], masks=None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(seqs), vocab] float32; ``masks`` (guided.GuideMasks) restricts the guided rows.
        Returns the chosen token per row and optional logprobs."""
        plain = all(_is_plain(s) for s in seqs)
        if not plain or masks is not None:
            logits = logits.clone()
        if masks is not None:
            masks.apply(logits)
        if not plain:
            for row, seq in enumerate(seqs):
                _adjust(logits[row], seq)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        choice = logits.argmax(dim=-1)
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            choice.index_copy_(
                0, rows, _sample_rows(logits.index_select(0, rows), [seqs[r] for r in sampled])
            )
        tokens = choice.tolist()  # the one host sync of the step
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
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=row.device)
        ok = ids < row.shape[0]
        bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
        row.index_add_(0, ids[ok], bias[ok])
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_ids, dtype=torch.long, device=row.device).unique(
            return_counts=True
        )
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Batched temperature / top-k / top-p / min-p sampling; returns one token id per row."""
    probs = sampling_probs(logits, seqs)
    keys = [mix_seed(s.seed, s.num_tokens) for s in seqs]
    return (probs / exponential_noise(keys, logits.shape[-1], logits.device)).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution each row samples from (temperature, top-k, top-p, min-p); rows may be
    unnormalised after min-p."""
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in seqs]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scores = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
        ranks = torch.arange(vocab, device=device)
        sorted_probs = torch.softmax(
            sorted_scores.masked_fill(ranks >= top_k[:, None], float("-inf")), dim=-1
        )
        top_p = torch.tensor([p.top_p for p in params], device=device)
        # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None], 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    else:
        probs = torch.softmax(scores, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs


_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3's finalizer on int64 tensors holding 32-bit values (products wrap; low bits are exact)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def exponential_noise(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [len(keys), vocab], a pure function of (key, token id): argmax(p / noise) draws
    from p, and a row's draw never depends on the other rows of the batch."""
    k = torch.tensor([[key & _M32, key >> 32] for key in keys], dtype=torch.long, device=device)
    ids = torch.arange(vocab, dtype=torch.long, device=device)
    h = _fmix32(_fmix32(ids[None, :] ^ k[:, :1]) ^ k[:, 1:])
    u = ((h >> 8).float() + 0.5) / 16777216.0
    # the top value, (2^24 - 0.5) / 2^24, rounds to 1.0 in float32: its noise would be 0 and p / 0 would pick the
    # token whatever its probability (a masked one included); it stands for -log(1 - 2^-25) ~ 2^-25
    return (-torch.log(u)).clamp_min(2.0**-25)
