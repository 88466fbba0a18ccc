"""Text that arrives in pieces: how much of its tail could be the start of a marker (and so is held back
until the next piece says), and the one ``<think>`` splitter the server's parsers and the terminal chat
share."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def held_back(text: str, *markers: str) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers`` (a proper prefix of it)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ReasoningSplitter:
    """Streamed text -> (is_reasoning, piece) pieces: what ``<think>`` ... ``</think>`` encloses is
    reasoning, the rest content, whatever the pieces' boundaries (a marker split across pieces is held
    back until it is whole). Whitespace before a leading ``<think>`` and right after ``</think>`` is
    layout and dropped.

    ``in_reasoning``: the text starts inside a block (DeepSeek-R1 and Nemotron answer that way, and so
    does any model whose prompt ended with ``<think>``); a leading ``<think>`` is dropped all the same.
    ``every_block``: each later ``<think>`` opens another block (a chat showing any server's text); off,
    only the first block is reasoning and a later ``<think>`` is content (a parser reading one model's
    format, where the tag may well be quoted in the answer)."""

    def __init__(self, in_reasoning: bool = False, every_block: bool = False):
        self.in_reasoning = in_reasoning
        self.every_block = every_block
        self._state = "start"  # start | reasoning | closed (after </think>, before content) | content
        self._held = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """The pieces ready to show; a possible partial marker is held back."""
        return self._split(text, final=False)

    def flush(self) -> list[tuple[bool, str]]:
        """What is held back, at the end of the text."""
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> list[tuple[bool, str]]:
        buf, self._held = self._held + text, ""
        out: list[tuple[bool, str]] = []
        while True:
            if self._state == "start":
                rest = buf.lstrip()
                if rest.startswith(OPEN):
                    buf, self._state = rest[len(OPEN) :], "reasoning"
                elif not final and OPEN.startswith(rest):
                    self._held = buf  # "", whitespace or the start of <think>: not decided yet
                    break
                else:
                    self._state = "reasoning" if self.in_reasoning else "content"
            elif self._state == "reasoning":
                at = buf.find(CLOSE)
                if at >= 0:
                    out.append((True, buf[:at]))
                    buf, self._state = buf[at + len(CLOSE) :], "closed"
                    continue
                hold = 0 if final else held_back(buf, CLOSE)
                out.append((True, buf[: len(buf) - hold]))
                self._held = buf[len(buf) - hold :]
                break
            elif self._state == "closed":
                buf = buf.lstrip()
                if not buf:
                    break
                self._state = "content"
            else:
                at = buf.find(OPEN) if self.every_block else -1
                if at >= 0:
                    out.append((False, buf[:at]))
                    buf, self._state = buf[at + len(OPEN) :], "reasoning"
                    continue
                hold = 0 if final or not self.every_block else held_back(buf, OPEN)
                out.append((False, buf[: len(buf) - hold]))
                self._held = buf[len(buf) - hold :]
                break
        return [(reasoning, piece) for reasoning, piece in out if piece]
