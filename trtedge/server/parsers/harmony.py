"""OpenAI harmony (gpt-oss): the output is a run of messages, each a header then ``<|message|>`` and a body
closed by ``<|end|>``, ``<|call|>`` or ``<|return|>``. The header names the channel: ``analysis`` is
reasoning, ``final`` the answer, ``commentary`` with a recipient ``to=functions.NAME`` a tool call whose
body is the JSON arguments (without a recipient, commentary is answer text)."""

from __future__ import annotations

import json
import re

from trtedge.server.parsers.json_scan import PartialCall

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def scan_harmony(text: str, final: bool) -> tuple[str, str, list[PartialCall]]:
    """(reasoning, content, calls) of ``text`` so far; an output without harmony markup is all content."""
    if "<|" not in text:
        return "", text[:-1] if not final and text.endswith("<") else text, []
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[PartialCall] = []
    pos = 0
    while pos < len(text):
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:
            if final and pos == 0:
                return "", text, []
            break  # the header is still being written
        header = text[pos:head_end]
        start = head_end + len(MESSAGE)
        end, stop = _body_end(text, start)
        complete = end is not None
        if end is None:
            end = len(text) if final else _held(text, start)
        body = text[start:end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            calls.append(_call(recipient.group(1), body, complete or final))
        elif channel is not None and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
        if not complete:
            break
        pos = stop
    return "".join(reasoning), "".join(content), calls


def _call(name: str, body: str, complete: bool) -> PartialCall:
    if not complete:
        return PartialCall(name, body.lstrip())
    arguments = body.strip() or "{}"
    try:
        ok = isinstance(json.loads(arguments), dict)
    except ValueError:
        ok = False
    return PartialCall(name, arguments if ok else json.dumps({"input": arguments}), True)


def _body_end(text: str, start: int) -> tuple[int | None, int]:
    found = [(i, m) for m in ENDS if (i := text.find(m, start)) >= 0]
    if not found:
        return None, len(text)
    i, marker = min(found)
    return i, i if marker == "<|start|>" else i + len(marker)


def _held(text: str, start: int) -> int:
    """Where the body seen so far ends: a trailing '<|...' may be the start of a closing marker."""
    k = text.rfind("<|", start)
    if k >= 0 and "|>" not in text[k:]:
        return k
    if text.endswith("<"):
        return len(text) - 1
    return len(text)
