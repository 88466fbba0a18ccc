"""Token logprobs in the shapes OpenAI's and vLLM's APIs report them: chat (``content`` entries with their
bytes), completions (tokens, token_logprobs, top_logprobs, text_offset) and vLLM's ``prompt_logprobs``.
``token`` gives a token's text and bytes (``ServingCore.token``)."""

from __future__ import annotations

from collections.abc import Callable

from trtedge.runtime.output import TokenLogprobs

TokenText = Callable[[int], tuple[str, bytes]]


def chat_logprobs(token: TokenText, infos: list[TokenLogprobs]) -> list[dict]:
    return [
        {
            **_entry(token, info.token_id, info.logprob),
            "top_logprobs": [_entry(token, t, lp) for t, lp in info.top],
        }
        for info in infos
    ]


def _entry(token: TokenText, token_id: int, logprob: float) -> dict:
    text, raw = token(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def completion_logprobs(token: TokenText, infos: list[TokenLogprobs], offset: int) -> dict:
    tokens, offsets = [], []
    for info in infos:
        text = token(info.token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [info.logprob for info in infos],
        "top_logprobs": [{token(t)[0]: lp for t, lp in info.top} for info in infos],
        "text_offset": offsets,
    }


def echo_logprobs(token: TokenText, ids: list[int], infos: list[TokenLogprobs | None] | None, k: int) -> dict:
    """The prompt's part of an echo's logprobs, in OpenAI's shape: the first token has none."""
    infos = infos or [None] * len(ids)
    tokens, offsets, offset = [], [], 0
    for t in ids:
        text = token(t)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [info.logprob if info is not None else None for info in infos],
        "top_logprobs": [
            {token(t)[0]: lp for t, lp in info.top[:k]} if info is not None else None for info in infos
        ],
        "text_offset": offsets,
    }


def joined(first: dict, second: dict) -> dict:
    """Two completion logprobs objects as one (the echoed prompt's, then the generated tokens')."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    token: TokenText, ids: list[int], infos: list[TokenLogprobs | None] | None, k: int
) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: null) its own entry and the top ``k``, each
    ``{token id: {logprob, rank, decoded_token}}``."""
    out: list = []
    for info in infos or [None] * len(ids):
        if info is None:
            out.append(None)
            continue
        entry = {str(info.token_id): _vllm_entry(token, info.token_id, info.logprob, info.rank)}
        for rank, (t, lp) in enumerate(info.top[:k], start=1):
            entry.setdefault(str(t), _vllm_entry(token, t, lp, rank))
        out.append(entry)
    return out


def _vllm_entry(token: TokenText, token_id: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": token(token_id)[0]}
