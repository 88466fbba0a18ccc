"""Tool-call formats: where a call starts in the generated text and how its body reads.

Each body reader takes (text, index, final, tools) and returns (calls so far, index past the body or
None while incomplete); it raises ``Malformed`` once the text can no longer be a call."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from trtedge.server.parsers.json_scan import (
    Malformed,
    PartialCall,
    call_list,
    call_object,
    skip_ws,
    value_end,
)

Body = Callable[[str, int, bool, dict], tuple[list[PartialCall], int | None]]


@dataclass(frozen=True)
class Format:
    """``start`` opens a call region (None: the output itself must begin with one of ``leaders``);
    ``end`` closes it (None: the region ends with its body)."""

    name: str
    body: Body
    start: str | None = None
    end: str | None = None
    leaders: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()  # markers dropped in front of the body (Llama's <|python_tag|>)
    keep_special_tokens: bool = False  # the markers are special tokens the detokenizer would hide


def _one_object(s: str, i: int, final: bool, tools: dict) -> tuple[list[PartialCall], int | None]:
    i = skip_ws(s, i)
    if i >= len(s):
        if final:
            raise Malformed("no tool call")
        return [], None
    call, end = call_object(s, i, final)
    return [call], end


def _list(s: str, i: int, final: bool, tools: dict) -> tuple[list[PartialCall], int | None]:
    return call_list(s, i, final)


def _semicolon_objects(s: str, i: int, final: bool, tools: dict) -> tuple[list[PartialCall], int | None]:
    # Llama 3.x: one or more {"name": ..., "parameters": ...} separated by ';'.
    calls: list[PartialCall] = []
    j = i
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            if final and calls:
                return calls, j
            if final:
                raise Malformed("no tool call")
            return calls, None
        call, end = call_object(s, j, final)
        calls.append(call)
        if end is None:
            return calls, None
        k = skip_ws(s, end)
        if k < len(s) and s[k] == ";":
            j = k + 1
            continue
        if k >= len(s) and not final:
            return calls, None  # a ';' and another call may follow
        return calls, end


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


def _mistral(s: str, i: int, final: bool, tools: dict) -> tuple[list[PartialCall], int | None]:
    # [TOOL_CALLS][{...}, ...] (v3 tokenizers) or [TOOL_CALLS]name[ARGS]{...} (v11+).
    j = skip_ws(s, i)
    if j < len(s) and s[j] in "[{":
        return call_list(s, j, final)
    name = _MISTRAL_NAME.match(s, j)
    k = name.end()
    if k >= len(s) or (not final and "[ARGS]".startswith(s[k:])):
        if final:
            raise Malformed("the tool call is incomplete")
        return [], None
    if not s.startswith("[ARGS]", k) or not name.group():
        raise Malformed("expected name[ARGS]{...}")
    at = k + len("[ARGS]")
    if at >= len(s):
        if final:
            raise Malformed("the tool call is incomplete")
        return [PartialCall(name.group())], None
    if s[at] != "{":
        raise Malformed("arguments must be an object")
    end = value_end(s, at)
    if end is None:
        if final:
            raise Malformed("the tool call is incomplete")
        return [PartialCall(name.group(), s[at:])], None
    try:
        args = json.loads(s[at:end])
    except ValueError:
        raise Malformed("arguments are not JSON") from None
    if not isinstance(args, dict):
        raise Malformed("arguments must be an object")
    return [PartialCall(name.group(), s[at:end], True)], end


_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


def _xml(s: str, i: int, final: bool, tools: dict) -> tuple[list[PartialCall], int | None]:
    # Qwen3-Coder: <function=NAME><parameter=K>V</parameter>...</function>
    j = skip_ws(s, i)
    head = _FUNCTION.match(s, j)
    if head is None:
        if final or not _opening(s[j:], "<function="):
            raise Malformed("expected <function=NAME>")
        return [], None
    name = head.group(1).strip()
    schema = (tools.get(name) or {}).get("properties") or {}
    entries: list[str] = []
    j = head.end()
    while True:
        j = skip_ws(s, j)
        if s.startswith("</function>", j):
            args = "{" + ", ".join(entries) + "}"
            return [PartialCall(name, args, True)], j + len("</function>")
        param = _PARAMETER.match(s, j)
        if param is None:
            if final or not (_opening(s[j:], "<parameter=") or "</function>".startswith(s[j:])):
                raise Malformed("expected <parameter=K> or </function>")
            break
        close = s.find("</parameter>", param.end())
        if close < 0:
            break
        key = param.group(1).strip()
        value = _xml_value(s[param.end() : close], schema.get(key) or {})
        entries.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        j = close + len("</parameter>")
    if final:
        raise Malformed("the tool call is incomplete")
    return [PartialCall(name, "{" + ", ".join(entries) if entries else "")], None


def _opening(rest: str, tag: str) -> bool:
    """``rest`` may still become ``tag`` + a name + '>'."""
    if tag.startswith(rest):
        return True
    return rest.startswith(tag) and not any(c in rest for c in ">\n")


def _xml_value(raw: str, schema: dict):
    text = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type")
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


FORMATS: dict[str, Format] = {
    "hermes": Format("hermes", _one_object, start="<tool_call>", end="</tool_call>"),
    "qwen3_xml": Format("qwen3_xml", _xml, start="<tool_call>", end="</tool_call>"),
    "llama3_json": Format(
        "llama3_json", _semicolon_objects, leaders=("<|python_tag|>", "{"), skip=("<|python_tag|>",)
    ),
    "mistral": Format("mistral", _mistral, start="[TOOL_CALLS]", keep_special_tokens=True),
    "nemotron": Format("nemotron", _list, start="<TOOLCALL>", end="</TOOLCALL>"),
    "generic": Format("generic", _list, leaders=("{", "[")),
    "openai": Format("openai", _list, keep_special_tokens=True),  # read by harmony.py, not by scan()
}
