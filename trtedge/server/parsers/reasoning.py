"""Reasoning split out of generated text: ``<think>...</think>`` becomes reasoning, the rest content
(the splitter is ``trtedge.runtime.text.streaming.ReasoningSplitter``, shared with the terminal chat).

qwen3: the output is reasoning only when it opens with <think> or the prompt ended with <think>
(thinking templates put it there); otherwise it is all content.
deepseek_r1, nemotron: the output starts in reasoning (a leading <think> is dropped) until </think>;
an output that never closes it is all reasoning (it was cut short)."""

from __future__ import annotations

from trtedge.runtime.text.streaming import ReasoningSplitter

STARTS_IN_REASONING = {"qwen3": False, "deepseek_r1": True, "nemotron": True}
HARMONY = "openai"  # gpt-oss channels, read by harmony.py


def reasoning_splitter(parser: str, opened: bool = False) -> ReasoningSplitter:
    """The splitter of ``parser``'s output; ``opened``: the prompt ended inside a reasoning block."""
    return ReasoningSplitter(in_reasoning=opened or STARTS_IN_REASONING[parser])
