"""Benchmark workloads: the prompts to send and how many tokens to ask for."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Random prompts skip the lowest ids, where tokenizers keep their special tokens.
FIRST_RANDOM_ID = 100


@dataclass(frozen=True)
class AudioPrompt:
    """A transcription request's audio file (``--dataset audio:FILE``); ``index`` tells the requests
    apart (offline, each gets its own faint dither, so that the encoder runs for every one)."""

    data: bytes = field(repr=False)
    name: str
    index: int = 0


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: token ids (random/fixed), text (files) or an audio file
    (transcriptions), and max_tokens."""

    prompt: str | list[int] | AudioPrompt
    prompt_len: int  # tokens when known; 0 for text the backend has not tokenized
    max_tokens: int


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Prompts of random token ids; lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if vocab_size <= FIRST_RANDOM_ID:
        raise ValueError(f"--vocab-size must exceed {FIRST_RANDOM_ID}, got {vocab_size}")
    rng = np.random.default_rng(seed)
    in_lens = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = rng.integers(FIRST_RANDOM_ID, vocab_size, size=n_in).tolist()
        requests.append(BenchRequest(ids, n_in, n_out))
    return requests


def fixed_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int):
    """The same random prompt of exactly ``input_len`` tokens, ``num_prompts`` times."""
    (one,) = random_requests(1, input_len, output_len, 0.0, vocab_size, seed)
    return [one] * num_prompts


def file_requests(path: str | Path, num_prompts: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Read a JSONL file of ``{"prompt": ..., "max_tokens": ...}`` lines or ShareGPT-style
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` records; a JSON
    array of such records works too. Draws ``num_prompts`` of them (seeded; with repeats if short)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    requests = [r for r in (_from_record(rec, output_len) for rec in records) if r is not None]
    if not requests:
        raise ValueError(f"{path}: no usable records (need 'prompt' or 'conversations' with a human turn)")
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(requests)).tolist()
    while len(picks) < num_prompts:
        picks += rng.permutation(len(requests)).tolist()
    return [requests[i] for i in picks[:num_prompts]]


def audio_requests(path: str | Path, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """``num_prompts`` transcriptions of the audio file at ``path`` (at most ``output_len`` tokens each)."""
    path = Path(path)
    data = path.read_bytes()
    return [BenchRequest(AudioPrompt(data, path.name, i), 0, output_len) for i in range(num_prompts)]


def _from_record(rec: dict, output_len: int) -> BenchRequest | None:
    if "prompt" in rec:
        return BenchRequest(rec["prompt"], 0, int(rec.get("max_tokens") or output_len))
    turns = rec.get("conversations") or rec.get("conversation") or []
    for i, turn in enumerate(turns):
        if turn.get("from", turn.get("role")) in ("human", "user"):
            answer = turns[i + 1].get("value", "") if i + 1 < len(turns) else ""
            # the reference answer's length (about 4 characters a token) stands in for max_tokens
            max_tokens = max(1, len(answer) // 4) if answer else output_len
            return BenchRequest(turn.get("value", turn.get("content", "")), 0, max_tokens)
    return None


def _uniform_lengths(rng, length: int, ratio: float, n: int) -> list[int]:
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()
