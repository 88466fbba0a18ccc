"""Tools for a chat template that cannot show them (llama.cpp's "generic" approach).

Some templates (both embedded models') render no tools: handed the tools, they give the same prompt
as without. Then the tool definitions and the call format go into the system prompt as text, earlier
calls and their results into the turns the template does render, and the model's answer is read
with the ``generic`` format: a JSON call object (or an array of them), anything else is the reply."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable

log = logging.getLogger("trtedge.server")

_PROBE = "trtedge_probe_tool"

INSTRUCTIONS = (
    "You can call the tools below. To call one, answer with only a JSON object, nothing before or "
    'after it: {"name": "<tool name>", "arguments": {<the arguments, as the tool\'s parameters '
    "describe>}}. To call several, answer with a JSON array of such objects. Otherwise answer in "
    "plain text.\n\nTools (name, description, JSON schema of the parameters):\n"
)


def renders_tools(render: Callable[..., str], template: str) -> bool:
    """Whether ``template`` shows its model the tools it is given; ``render(messages, tools=...)``
    renders through it."""
    return _renders_tools(render, template)


@functools.lru_cache(maxsize=32)
def _renders_tools(render: Callable[..., str], template: str) -> bool:
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}]
    try:
        shown = _PROBE in render([{"role": "user", "content": "hi"}], tools=probe)
    except Exception:  # a template that cannot render the probe is not one we can show tools with
        shown = False
    if not shown:
        log.info(
            "the chat template shows its model no tools: requests with tools get the tool definitions "
            "and the call format in the system prompt, and calls are read as JSON (generic format)"
        )
    return shown


def tool_system_prompt(tools: list[dict]) -> str:
    lines = []
    for tool in tools:
        function = tool["function"]
        entry = {
            "name": function["name"],
            "description": function.get("description") or "",
            "parameters": function.get("parameters") or {},
        }
        lines.append(json.dumps(entry, ensure_ascii=False))
    return INSTRUCTIONS + "\n".join(lines)


def with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tools in the system prompt, calls written as the model is told to write
    them and tool results as user turns (templates without tools know neither)."""
    prompt = tool_system_prompt(tools)
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in m["tool_calls"]
            ]
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            content = m.get("content") or ""
            message = {k: v for k, v in m.items() if k != "tool_calls"}
            message["content"] = f"{content}\n{text}" if isinstance(content, str) and content else text
            out.append(message)
        elif m["role"] == "tool":
            result = {"tool_result": {"call_id": m.get("tool_call_id"), "content": m.get("content")}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            out.append(m)
    if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
