"""Batched sampling with per-request parameters.

Every sampled row draws its randomness from a generator keyed on (seed, position), so a seeded
request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.ops import triton_sampling

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a counter-based key for one draw."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_HALF = 1 << 63


def _signed64(value: int) -> int:
    """``value`` modulo 2**64 as the int64 of the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= _HALF else value


def race_rows(seeds: list[int], positions: list[int], temperatures: list[float]) -> torch.Tensor:
    """The seeded race's per-row inputs in one host tensor for one copy ([3 * n] int64): the seeds (as
    the int64 of their bits modulo 2**64), the positions, then each temperature's float32 bits. The
    race mixes each (seed, position) into its key on the device (``triton_sampling.race_logits_seeded``)."""
    rows = array.array("q", [s if 0 <= s < _HALF else _signed64(s) for s in seeds])
    rows.extend(positions)
    bits = array.array("i")
    bits.frombytes(array.array("f", temperatures).tobytes())
    rows.extend(bits.tolist())
    return torch.frombuffer(rows, dtype=torch.long)


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
        """logits: [len(seqs), vocab] float32 (or the model's dtype, as the decode graphs give them:
        read as they are where no pass changes them); ``masks`` (guided.GuideMasks) restricts the guided rows.
        Returns the chosen token per row and optional logprobs (waits for the device)."""
        return self.sample(logits, seqs, masks).host()

    def sample(
        self, logits: torch.Tensor, seqs: list, masks=None, positions: list[int] | None = None
    ) -> SampleResult:
        """Enqueue the sampling of every row on the device, without waiting for it. ``positions``: the
        token count each row samples at (its key into the seeded stream); default ``row.num_tokens``."""
        plain = all(is_plain(s.params) for s in seqs)
        if not plain or masks is not None:  # changed in place below: a float32 copy
            logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
        if masks is not None:
            masks.apply(logits)
        if not plain:
            for row, seq in enumerate(seqs):
                _adjust(logits[row], seq)
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if positions is None and sampled:
            positions = [s.num_tokens for s in seqs]
        if sampled and len(sampled) == len(seqs):  # no greedy row: no argmax pass over the logits
            choice = _sample_rows(logits, seqs, positions)
        else:
            choice = logits.argmax(dim=-1)
            if sampled:
                rows = [seqs[r] for r in sampled]
                index = to_device(sampled, torch.long, logits.device)
                drawn = _sample_rows(logits.index_select(0, index), rows, [positions[r] for r in sampled])
                choice.index_copy_(0, index, drawn)
        ks = [s.params.logprobs for s in seqs]
        top_k = max((k for k in ks if k is not None), default=None)
        chosen_lp = top_values = top_ids = None
        if top_k is not None:
            logprobs_all = torch.log_softmax(logits.float(), dim=-1)
            chosen_lp = logprobs_all.gather(1, choice[:, None])[:, 0]
            if top_k > 0:
                top_values, top_ids = logprobs_all.topk(top_k, dim=-1)
        return SampleResult(choice, ks, chosen_lp, top_ids, top_values)


class SampleResult:
    """One step's sampled tokens (and logprobs) on the device; ``host()`` copies them back. The copy
    starts at once, into pinned memory where the device has some, so ``host()`` waits only for the
    step itself."""

    def __init__(self, tokens: torch.Tensor, ks, chosen_lp, top_ids, top_values):
        self.tokens = tokens  # [rows] long, on the device: the next step's inputs may read it there
        self._ks = ks
        self._event = None
        if tokens.is_cuda:
            self._host = [_pinned_copy(tokens)]
            if chosen_lp is not None:
                self._host.append(_pinned_copy(chosen_lp))
                if top_ids is not None:
                    self._host += [_pinned_copy(top_ids), _pinned_copy(top_values)]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = [tokens] + ([chosen_lp] if chosen_lp is not None else [])
            if chosen_lp is not None and top_ids is not None:
                self._host += [top_ids, top_values]

    def host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host[0].tolist()
        if len(self._host) == 1:
            return tokens, [None] * len(tokens)
        chosen = self._host[1].tolist()
        top_ids = self._host[2].tolist() if len(self._host) > 2 else None
        top_values = self._host[3].tolist() if len(self._host) > 2 else None
        infos: list[TokenLogprobs | None] = []
        for row, k in enumerate(self._ks):
            if k is None:
                infos.append(None)
                continue
            top = list(zip(top_ids[row][:k], top_values[row][:k])) if k > 0 else []
            infos.append(TokenLogprobs(tokens[row], chosen[row], top))
        return tokens, infos


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device's queue: staged in pinned memory
    (a plain ``torch.tensor(..., device=cuda)`` copy, or one from pageable memory past a few KiB, waits
    for every kernel queued before it)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return upload(host_tensor(values, dtype), device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the CUDA ``device`` through pinned memory, without waiting for the device."""
    return host.pin_memory().to(device, non_blocking=True)


_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A flat host list as a tensor: through ``array`` where the dtype maps to one (several times
    faster than ``torch.tensor`` reading a list element by element, which costs ~0.1 us a value: the
    engine stages thousands a step); nested or unusual lists as ``torch.tensor`` takes them."""
    code = _TYPECODES.get(dtype)
    if code is not None and values and not isinstance(values[0], (list, tuple)):
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):
            pass
    return torch.tensor(values, dtype=dtype)


def is_plain(p) -> bool:
    """No logit bias or penalties: the row samples from its logits alone."""
    return (
        not p.logit_bias
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
    )


def temperature_only(p) -> bool:
    """A row that samples from softmax(logits / T) as it is: no top-k, top-p or min-p cut."""
    return p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0


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


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
    """Batched temperature / top-k / top-p / min-p sampling; returns one token id per row."""
    if triton_sampling.supported(logits) and all(temperature_only(s.params) for s in seqs):
        # the race straight from the logits: no softmax pass and no probability tensor; its inputs
        # (keys and temperatures) go to the device in one copy
        host = race_rows([s.seed for s in seqs], positions, [s.params.temperature for s in seqs])
        return triton_sampling.race_logits_seeded(logits, upload(host, logits.device))
    keys = [mix_seed(s.seed, pos) for s, pos in zip(seqs, positions)]
    probs = sampling_probs(logits, seqs)
    if triton_sampling.supported(probs):  # the same race in one pass (the torch lines are its reference)
        return triton_sampling.race(probs, to_device(split_keys(keys), torch.long, probs.device))
    return (probs / exponential_noise(keys, logits.shape[-1], logits.device)).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution each row samples from (temperature, top-k, top-p, min-p); rows may be
    unnormalised after min-p."""
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in seqs]
    temperature = to_device([p.temperature for p in params], torch.float32, device)
    scores = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        top_k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.long, device)
        ranks = torch.arange(vocab, device=device)
        sorted_probs = torch.softmax(
            sorted_scores.masked_fill(ranks >= top_k[:, None], float("-inf")), dim=-1
        )
        top_p = to_device([p.top_p for p in params], torch.float32, device)
        # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None], 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    else:
        probs = torch.softmax(scores, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, device)
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


def split_keys(keys: list[int]) -> list[list[int]]:
    """64-bit keys as (low, high) 32-bit halves, the two words the noise hash mixes in."""
    return [[key & _M32, key >> 32] for key in keys]


def exponential_noise(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [len(keys), vocab], a pure function of (key, token id): argmax(p / noise) draws
    from p, and a row's draw never depends on the other rows of the batch."""
    k = to_device(split_keys(keys), torch.long, device)
    ids = torch.arange(vocab, dtype=torch.long, device=device)
    h = _fmix32(_fmix32(ids[None, :] ^ k[:, :1]) ^ k[:, 1:])
    u = ((h >> 8).float() + 0.5) / 16777216.0
    # the top value, (2^24 - 0.5) / 2^24, rounds to 1.0 in float32: its noise would be 0 and p / 0 would pick the
    # token whatever its probability (a masked one included); it stands for -log(1 - 2^-25) ~ 2^-25
    return (-torch.log(u)).clamp_min(2.0**-25)
