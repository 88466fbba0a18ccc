"""Tool calls out of generated text, whole or streamed.

``parse_tool_calls`` reads a finished output; ``ToolCallStream`` reads it delta by delta and says what is
new: content as soon as it cannot be the start of a call, a call's head (index, name) as soon as its name
is known, then argument fragments. The fragments of a call add up to the arguments the whole-text parse
gives, and the streamed content to its content (for well-formed output). Text that cannot be parsed as
a call falls back to content."""

from __future__ import annotations

from dataclasses import dataclass, field

from trtedge.runtime.text.streaming import held_back
from trtedge.server.parsers.formats import FORMATS, Format
from trtedge.server.parsers.harmony import scan_harmony
from trtedge.server.parsers.json_scan import Malformed, PartialCall, skip_ws


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def scan(fmt: Format, text: str, final: bool, tools: dict | None = None) -> Parsed:
    """The content and calls of ``text`` so far. Without ``final`` the content stops where a call might
    begin, and calls may be partial."""
    tools = tools or {}
    if fmt.name == "openai":
        _, content, calls = scan_harmony(text, final)
        return Parsed(content, calls)
    if fmt.start is None:
        return _scan_leading(fmt, text, final, tools)
    content: list[str] = []
    calls: list[PartialCall] = []
    pos, after_call = 0, False
    while True:
        k = text.find(fmt.start, pos)
        if k < 0:
            tail = text[pos:]
            if not final:
                tail = tail[: len(tail) - held_back(tail, fmt.start)]
            content.append(_between(tail, after_call, closed=final))
            break
        content.append(_between(text[pos:k], after_call, closed=True))
        try:
            body, end = fmt.body(text, k + len(fmt.start), final, tools)
            if end is not None and fmt.end is not None:
                j = skip_ws(text, end)
                if text.startswith(fmt.end, j):
                    end = j + len(fmt.end)
                elif not final and fmt.end.startswith(text[j:]):
                    end = None  # the closing marker may still come
                elif j < len(text):
                    raise Malformed(f"expected {fmt.end}")
        except Malformed:
            content.append(text[k:])
            break
        calls += body
        if end is None:
            break
        pos, after_call = end, True
    return Parsed("".join(content), calls)


def _scan_leading(fmt: Format, text: str, final: bool, tools: dict) -> Parsed:
    i = skip_ws(text, 0)
    rest = text[i:]
    if not rest:
        return Parsed(text if final else "")
    if not any(rest.startswith(m) for m in fmt.leaders):
        if not final and any(m.startswith(rest) for m in fmt.leaders):
            return Parsed("")
        return Parsed(text)
    for marker in fmt.skip:
        if rest.startswith(marker):
            i += len(marker)
    try:
        calls, end = fmt.body(text, i, final, tools)
    except Malformed:
        return Parsed(text)
    if not calls or calls[0].name is None:
        return Parsed("")  # nothing recognisable yet (final always raised or named a call)
    if end is None:
        return Parsed("", calls)
    tail = text[end:]
    return Parsed(_between(tail, True, closed=final), calls)


def _between(segment: str, after_call: bool, closed: bool) -> str:
    # Whitespace after a call is layout, not content; text after a call is content.
    if after_call and not segment.strip():
        return ""
    return segment


def parse_tool_calls(fmt: Format, text: str, tools: dict | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output."""
    parsed = scan(fmt, text, True, tools)
    return parsed.content, [ToolCall(c.name, c.arguments) for c in parsed.calls if c.name]


@dataclass
class ToolCallStream:
    """Feed deltas; each ``feed`` returns the events they complete:
    ("content", text), ("call", index, name), ("arguments", index, fragment)."""

    fmt: Format | None
    tools: dict | None = None
    text: str = ""
    _content: str = ""
    _sent: list[int] = field(default_factory=list)  # argument characters sent, per call

    def feed(self, delta: str, final: bool = False) -> list[tuple]:
        self.text += delta
        return self.emit(scan(self.fmt, self.text, final, self.tools))

    def emit(self, parsed: Parsed) -> list[tuple]:
        """The events that take what was sent so far to ``parsed``."""
        events: list[tuple] = []
        if parsed.content.startswith(self._content) and len(parsed.content) > len(self._content):
            events.append(("content", parsed.content[len(self._content) :]))
            self._content = parsed.content
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self._sent):
                events.append(("call", i, call.name))
                self._sent.append(0)
            elif i > len(self._sent):
                break
            sent = self._sent[i]
            if len(call.arguments) > sent:
                events.append(("arguments", i, call.arguments[sent:]))
                self._sent[i] = len(call.arguments)
        return events

    @property
    def num_calls(self) -> int:
        return len(self._sent)


def tool_format(name: str) -> Format:
    return FORMATS[name]
