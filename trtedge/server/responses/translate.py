"""OpenAI Responses input -> the OpenAI chat request the translation core serves."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from trtedge.server.errors import bad_request, not_supported
from trtedge.server.multimodal import audio_part, media_part, take_media_params
from trtedge.server.openai.protocol import ChatCompletionRequest
from trtedge.server.responses.protocol import ResponsesRequest

log = logging.getLogger("trtedge.server")

_TEXT = ("input_text", "output_text", "text", "refusal")
# Tools that OpenAI runs on its side; Codex sends web_search on every request.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "mcp",
    }
)
_skipped: set[str] = set()  # hosted tool types already logged
_EFFORTS = ("none", "minimal", "low", "medium", "high")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise bad_request(
            "trtedge does not store responses: send the whole conversation in input instead of "
            "previous_response_id",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input.{i}" if isinstance(req.input, list) else "input")
    body: dict[str, Any] = {"messages": messages, "priority": req.priority}
    if req.tools:
        body["tools"] = [f for i, t in enumerate(req.tools) for f in _tools(t, f"tools.{i}")]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    for name in ("parallel_tool_calls", "temperature", "top_p", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise bad_request(
                f"reasoning.effort must be one of {', '.join(_EFFORTS)}", param="reasoning.effort"
            )
        body["reasoning_effort"] = effort
        body["enable_thinking"] = effort != "none"
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        if fmt["type"] == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
    media_params = take_media_params(messages)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        raise bad_request(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None
    chat._media_params = media_params
    return chat


def _add_item(messages: list[dict], item: dict, param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request("role must be user, system, developer or assistant", param=f"{param}.role")
        messages.append({"role": "system" if role == "developer" else role, "content": _content(item, param)})
    elif kind == "function_call":
        name = _string(item, "name", param)
        if isinstance(item.get("namespace"), str):
            name = f"{item['namespace']}.{name}"
        call = {
            "id": _string(item, "call_id", param),
            "type": "function",
            "function": {
                "name": name,
                "arguments": _string(item, "arguments", param),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content({"content": output}, f"{param}.output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
    elif kind == "reasoning":
        return  # earlier reasoning is not sent back to the model (chat templates drop it too)
    else:
        raise not_supported(f"an input item of type {kind!r}", f"{param}.type")


def _content(item: dict, param: str) -> str | list[dict]:
    """The text of an item's content, or its parts when it holds images."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of parts", param=f"{param}.content")
    parts = []
    for j, part in enumerate(content):
        where = f"{param}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image(part, where))
            continue
        if kind == "input_audio":
            parts.append(_audio(part, where))
            continue
        if kind not in _TEXT:
            raise not_supported(f"a {kind!r} content part", where)
        parts.append(
            {"type": "text", "text": _string(part, "refusal" if kind == "refusal" else "text", where)}
        )
    if any(p["type"] != "text" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image(part: dict, param: str) -> dict:
    if part.get("detail") not in (None, "auto", "low", "high"):
        raise bad_request('detail must be "auto", "low" or "high"', param=f"{param}.detail")
    if isinstance(part.get("image_url"), str):
        return media_part(part["image_url"], f"{param}.image_url", part.get("detail"))
    if part.get("file_id") is not None:
        raise not_supported(
            "file_id (trtedge has no Files API: send image_url, a data: URL or a file path)",
            f"{param}.file_id",
        )
    raise bad_request("an input_image needs image_url (a string)", param=f"{param}.image_url")


def _audio(part: dict, param: str) -> dict:
    source = part.get("input_audio")
    if not isinstance(source, dict):
        raise bad_request('an input_audio part needs input_audio: {"data": ..., "format": ...}', param=param)
    where = f"{param}.input_audio"
    return audio_part(_string(source, "data", where), _string(source, "format", where), where)


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{key} must be a string", param=f"{param}.{key}")
    return value


def _tools(tool: dict, param: str) -> list[dict]:
    """The function tools of one entry of ``tools``: itself, a namespace's functions (named
    ``namespace.name`` in the prompt), or none for a hosted tool the server cannot run."""
    kind = tool.get("type")
    if kind == "namespace":
        namespace = _string(tool, "name", param)
        members = tool.get("tools")
        if not isinstance(members, list):
            raise bad_request("a namespace needs tools (a list)", param=f"{param}.tools")
        out = []
        for j, member in enumerate(members):
            where = f"{param}.tools.{j}"
            if not isinstance(member, dict):
                raise bad_request("a tool must be an object", param=where)
            function = _tool(member, where)["function"]
            function["name"] = f"{namespace}.{function['name']}"
            out.append({"type": "function", "function": function})
        return out
    if kind in HOSTED_TOOLS:
        if kind not in _skipped:
            _skipped.add(kind)
            log.info("tools of type %r run on OpenAI's servers: left out of the prompt", kind)
        return []
    return [_tool(tool, param)]


def namespaces(tools: list[dict] | None) -> dict[str, tuple[str, str]]:
    """Prompt name -> (namespace, name) of each namespaced function in ``tools``."""
    out = {}
    for tool in tools or ():
        if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for member in tool["tools"]:
                out[f"{tool['name']}.{member['name']}"] = (tool["name"], member["name"])
    return out


def _tool(tool: dict, param: str) -> dict:
    if tool.get("type") != "function":
        raise not_supported(
            f"the tool type {tool.get('type')!r} (function and namespace tools are served)", f"{param}.type"
        )
    function = {"name": _string(tool, "name", param)}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or {}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    raise not_supported(f"tool_choice of type {choice.get('type')!r}", "tool_choice.type")
