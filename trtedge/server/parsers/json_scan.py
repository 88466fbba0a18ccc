"""Incremental JSON scanning for tool calls: where a value ends (or that it has not ended yet), and the
fields of a call object ``{"name": ..., "arguments": {...}}`` read from a prefix of the text."""

from __future__ import annotations

import json
from dataclasses import dataclass

WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


class Malformed(ValueError):
    """The text can no longer become a tool call: the caller shows it as content."""


@dataclass(frozen=True)
class PartialCall:
    """A tool call read so far. ``arguments`` is always a prefix of the final arguments JSON text;
    ``done`` once the call is complete."""

    name: str | None
    arguments: str = ""
    done: bool = False


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """The index just past the JSON value starting at ``s[i]``; None while the text stops inside it.
    Brackets and strings are matched; the value's grammar is checked later with json.loads."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        j = i + 1
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "]}":
                if c != stack.pop():
                    raise Malformed(f"unbalanced {c!r}")
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in WS + ",]};":
        j += 1
    if j == len(s):
        return None  # a number or literal may go on
    try:
        json.loads(s[i:j])
    except ValueError:
        raise Malformed(f"not JSON: {s[i:j]!r}") from None
    return j


def _string_end(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise Malformed(f"not JSON: {text[:80]!r}") from None


def call_object(s: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
    """Read ``{"name": str, "arguments"|"parameters": object}`` starting at ``s[i]`` ('{').
    Returns the call so far and the index past it (None while incomplete)."""
    if s[i] != "{":
        raise Malformed("a tool call must be a JSON object")
    name: str | None = None
    args_at: int | None = None
    args_end: int | None = None
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            break
        if s[j] == "}":
            return _finish(s, name, args_at, args_end), j + 1
        if s[j] != '"':
            raise Malformed("expected a key")
        key_end = _string_end(s, j)
        if key_end is None:
            break
        key = _loads(s[j:key_end])
        j = skip_ws(s, key_end)
        if j >= len(s):
            break
        if s[j] != ":":
            raise Malformed("expected ':'")
        j = skip_ws(s, j + 1)
        if j >= len(s):
            break
        end = value_end(s, j)
        if key == "name":
            if s[j] != '"':
                raise Malformed("the name must be a string")
            if end is not None:
                name = _loads(s[j:end])
        elif key in ("arguments", "parameters"):
            if s[j] not in '{"':
                raise Malformed("arguments must be an object")
            args_at, args_end = j, end
        if end is None:
            break
        j = skip_ws(s, end)
        if j >= len(s):
            break
        if s[j] == ",":
            j += 1
        elif s[j] != "}":
            raise Malformed("expected ',' or '}'")
    if final:
        raise Malformed("the tool call is incomplete")
    return PartialCall(name, _partial_args(s, args_at, args_end)), None


def _partial_args(s: str, at: int | None, end: int | None) -> str:
    if at is None or s[at] == '"':
        return ""  # a JSON-encoded string is only known once it is complete
    return s[at : end if end is not None else len(s)]


def _finish(s: str, name: str | None, at: int | None, end: int | None) -> PartialCall:
    if not name:
        raise Malformed("a tool call needs a name")
    if at is None:
        return PartialCall(name, "{}", True)
    raw = s[at:end]
    value = _loads(raw)
    if isinstance(value, str):
        raw, value = value, _loads(value)
    if not isinstance(value, dict):
        raise Malformed("arguments must be an object")
    return PartialCall(name, raw, True)


def call_list(s: str, i: int, final: bool) -> tuple[list[PartialCall], int | None]:
    """One call object, or a JSON array of them, starting at ``s[i]``."""
    i = skip_ws(s, i)
    if i >= len(s):
        if final:
            raise Malformed("no tool call")
        return [], None
    if s[i] == "{":
        call, end = call_object(s, i, final)
        return [call], end
    if s[i] != "[":
        raise Malformed("expected a JSON object or array")
    calls: list[PartialCall] = []
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            break
        if s[j] == "]" and not calls:
            raise Malformed("an empty list of tool calls")
        call, end = call_object(s, j, final)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(s, end)
        if j >= len(s):
            break
        if s[j] == "]":
            return calls, j + 1
        if s[j] != ",":
            raise Malformed("expected ',' or ']'")
        j += 1
    if final:
        raise Malformed("the list of tool calls is incomplete")
    return calls, None
