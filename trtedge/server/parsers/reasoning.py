"""Reasoning split out of generated text: ``<think>...</think>`` becomes reasoning, the rest content.

qwen3: the output is reasoning only when it opens with <think> or the prompt ended with <think>
(thinking templates put it there); otherwise it is all content.
deepseek_r1, nemotron: the output starts in reasoning (a leading <think> is dropped) until </think>;
an output that never closes it is all reasoning (it was cut short)."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
STARTS_IN_REASONING = {"qwen3": False, "deepseek_r1": True, "nemotron": True}
HARMONY = "openai"  # gpt-oss channels, read by harmony.py


def split_reasoning(parser: str, text: str, final: bool, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) of ``text`` so far; without ``final`` a possible partial marker is held back.
    ``opened``: the prompt ended inside a reasoning block."""
    rest = text.lstrip()
    if rest.startswith(OPEN):
        start = len(text) - len(rest) + len(OPEN)
    elif not final and OPEN.startswith(rest):
        return "", ""
    elif opened or STARTS_IN_REASONING[parser]:
        start = 0
    else:
        return "", text
    end = text.find(CLOSE, start)
    if end < 0:
        reasoning = text[start:]
        if not final:
            reasoning = reasoning[: len(reasoning) - _held(reasoning)]
        return reasoning, ""
    return text[start:end], text[end + len(CLOSE) :].lstrip()


def _held(text: str) -> int:
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if text.endswith(CLOSE[:n]):
            return n
    return 0
