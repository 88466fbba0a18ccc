"""One choice's output read as it streams: reasoning, content and tool calls, as events.

Events: ("reasoning", text), ("content", text), ("call", index, name), ("arguments", index, fragment).
A whole output read in one ``feed(text, final=True)`` gives the same events, merged."""

from __future__ import annotations

from dataclasses import dataclass, field

from trtedge.server.parsers.formats import Format
from trtedge.server.parsers.harmony import scan_harmony
from trtedge.server.parsers.reasoning import reasoning_splitter
from trtedge.server.parsers.tool_calls import Parsed, ToolCall, ToolCallStream


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class OutputParser:
    def __init__(
        self,
        reasoning_parser: str | None = None,
        tool_format: Format | None = None,
        tools: dict | None = None,
        opened: bool = False,
    ):
        self.reasoning_parser = reasoning_parser
        self.tools = ToolCallStream(tool_format, tools) if tool_format is not None else None
        harmony = reasoning_parser == "openai" or (tool_format is not None and tool_format.name == "openai")
        self._splitter = (
            None if reasoning_parser is None or harmony else reasoning_splitter(reasoning_parser, opened)
        )
        self._text = ""  # harmony: the whole output so far (its channels are scanned whole)
        self._reasoning = 0

    def feed(self, delta: str, final: bool = False) -> list[tuple]:
        events: list[tuple] = []
        if self.reasoning_parser == "openai" or (self.tools is not None and self.tools.fmt.name == "openai"):
            self._text += delta
            reasoning, content, calls = scan_harmony(self._text, final)
            if len(reasoning) > self._reasoning:
                events.append(("reasoning", reasoning[self._reasoning :]))
                self._reasoning = len(reasoning)
            if self.tools is None:
                self.tools = ToolCallStream(None)
            return events + self.tools.emit(Parsed(content, calls))
        if self._splitter is None:
            content_delta = delta
        else:
            pieces = self._splitter.feed(delta) + (self._splitter.flush() if final else [])
            reasoning = "".join(piece for is_reasoning, piece in pieces if is_reasoning)
            if reasoning:
                events.append(("reasoning", reasoning))
            content_delta = "".join(piece for is_reasoning, piece in pieces if not is_reasoning)
        if self.tools is None:
            if content_delta:
                events.append(("content", content_delta))
        else:
            events += self.tools.feed(content_delta, final)
        return events

    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once."""
        return merge(self.feed(text, final=True))


def merge(events: list[tuple]) -> ParsedOutput:
    out = ParsedOutput()
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        if event[0] == "reasoning":
            out.reasoning += event[1]
        elif event[0] == "content":
            out.content += event[1]
        elif event[0] == "call":
            names[event[1]] = event[2]
            args[event[1]] = []
        else:
            args[event[1]].append(event[2])
    out.calls = [ToolCall(names[i], "".join(args[i])) for i in sorted(names)]
    return out
