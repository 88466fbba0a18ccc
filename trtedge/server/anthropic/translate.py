"""Anthropic Messages <-> the OpenAI chat request the translation core serves."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from pydantic import ValidationError

from trtedge.server.anthropic.protocol import CountTokensRequest, MessagesRequest, OutputFormat
from trtedge.server.errors import APIError, bad_request, not_supported
from trtedge.server.multimodal import media_part, take_media_params
from trtedge.server.openai.protocol import ChatCompletionRequest

log = logging.getLogger("trtedge.server")

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
# Tools Anthropic defines by a versioned type: web_search_20250305, web_fetch_..., code_execution_...
# run on Anthropic's servers; bash_..., text_editor_..., computer_..., memory_... have schemas of
# Anthropic's own. A request carries no definition of either to show a local model.
_ANTHROPIC_TOOL = re.compile(r"[a-z][a-z_]{0,40}_\d{8}")
_MAX_LOGGED = 32
_skipped: set[str] = set()  # Anthropic tool types already logged (at most _MAX_LOGGED)


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages += _messages(m.role, m.content, f"messages.{i}.content")
    body: dict[str, Any] = {"messages": messages}
    if req.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools) if not _left_out(t)]
    if req.tool_choice is not None:
        body["tool_choice"], parallel = _tool_choice(req.tool_choice)
        if parallel is False:
            body["parallel_tool_calls"] = False
    thinking = (req.thinking or {}).get("type")
    if thinking is not None:
        if thinking not in ("enabled", "disabled", "adaptive"):
            raise bad_request(
                'thinking.type must be "enabled", "disabled" or "adaptive"', param="thinking.type"
            )
        body["enable_thinking"] = thinking != "disabled"
    config = req.output_config
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = _EFFORTS[config.effort]
    fmt = _output_format(req)
    if fmt is not None:
        schema = {"name": "output", "schema": fmt.schema_, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        user = (req.metadata or {}).get("user_id")
        if isinstance(user, str):
            body["user"] = user
    media_params = take_media_params(messages)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        raise bad_request(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None
    chat._media_params = media_params
    return chat


# Anthropic's effort levels -> the reasoning efforts chat templates know (xhigh and max: the highest)
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _output_format(req: MessagesRequest | CountTokensRequest) -> OutputFormat | None:
    inside = req.output_config.format if req.output_config is not None else None
    beta = req.output_format
    if inside is not None and beta is not None:
        raise bad_request(
            "set output_config.format or output_format (its older name), not both", param="output_format"
        )
    return inside or beta


def _messages(role: str, content: str | list[dict], param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    parts: list[dict] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", where)})
        elif kind == "image" and role == "user":
            parts.append(_image(block, where))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request("input must be an object", param=f"{where}.input")
            function = {"name": _string(block, "name", where), "arguments": json.dumps(arguments)}
            calls.append({"id": _string(block, "id", where), "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text(result, f"{where}.content")
            results.append(
                {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where), "content": text}
            )
        elif kind == "thinking" and role == "assistant":
            reasoning.append(_string(block, "thinking", where))
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        else:
            raise not_supported(f"a {kind!r} block in a {role} message", where)
    out = list(results)
    texts = [p["text"] for p in parts if p["type"] == "text"]
    if role == "assistant":
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        out.append(message)
    elif len(texts) < len(parts):
        out.append({"role": role, "content": parts})
    elif texts or not results:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def _image(block: dict, param: str) -> dict:
    source = block.get("source")
    where = f"{param}.source"
    if not isinstance(source, dict):
        raise bad_request('an image block needs a source: {"type": "base64" | "url", ...}', param=where)
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if media_type not in IMAGE_TYPES:
            raise bad_request(
                f"media_type must be one of {', '.join(IMAGE_TYPES)}", param=f"{where}.media_type"
            )
        return media_part(f"data:{media_type};base64,{_string(source, 'data', where)}", where)
    if kind == "url":
        return media_part(_string(source, "url", where), where)
    raise not_supported(f"an image source of type {kind!r}", f"{where}.type")


def _text(blocks: str | list[dict], param: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise not_supported(f"a {block.get('type')!r} block here", f"{param}.{j}")
        texts.append(_string(block, "text", f"{param}.{j}"))
    return "\n".join(texts)


def _string(block: dict, key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{key} must be a string", param=f"{param}.{key}")
    return value


def _left_out(tool: dict) -> bool:
    """Whether ``tool`` is one of Anthropic's versioned tools, left out of the prompt (logged once per type)."""
    kind = tool.get("type")
    if not isinstance(kind, str) or not _ANTHROPIC_TOOL.fullmatch(kind):
        return False
    if kind not in _skipped and len(_skipped) < _MAX_LOGGED:
        _skipped.add(kind)
        log.info(
            "tools of type %r are defined by Anthropic, not by the request: left out of the prompt", kind
        )
    return True


def _tool(tool: dict, param: str) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise not_supported(
            f"the tool type {json.dumps(tool.get('type'))} (client tools are custom; Anthropic's "
            "versioned tools such as web_search_20250305 are left out of the prompt)",
            f"{param}.type",
        )
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request("input_schema must be a JSON schema object", param=f"{param}.input_schema")
    function = {"name": _string(tool, "name", param)}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = schema
    return {"type": "function", "function": function}


def _tool_choice(choice: dict) -> tuple[str | dict, bool | None]:
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}, parallel
    raise bad_request('tool_choice.type must be "auto", "any", "tool" or "none"', param="tool_choice.type")


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "overloaded_error",
    529: "overloaded_error",
}


def error_body(error: APIError) -> tuple[int, dict]:
    """Anthropic's error shape; a full queue (429 elsewhere) is 529 overloaded_error, as Anthropic sends."""
    status = 529 if error.status == 429 else error.status
    kind = _TYPES.get(status, "api_error")
    message = (
        f"{error.param}: {error.message}"
        if error.param and error.param not in error.message and error.code != "context_length_exceeded"
        else error.message
    )
    return status, {"type": "error", "error": {"type": kind, "message": message}}
