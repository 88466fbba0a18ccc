"""Guides that enforce a tool call (tool_choice "required" or a named function) in a model's tool-call
format: xgrammar structural tags whose JSON parts are the functions' parameter schemas."""

from __future__ import annotations

from trtedge.runtime.sampling_params import GuidedDecodingParams
from trtedge.server.parsers.formats import Format


def _json(schema: dict, style: str = "json") -> dict:
    # one whitespace character at most between tokens: small models loop on whitespace
    return {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": 1}


def _call_schema(tool: dict, arguments_key: str) -> dict:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments_key: function.get("parameters") or {"type": "object"},
        },
        "required": ["name", arguments_key],
    }


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _xml_call(tool: dict) -> dict:
    function = tool["function"]
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": f"<tool_call>\n<function={function['name']}>\n"},
            _json(function.get("parameters") or {"type": "object"}, "qwen_xml"),
            {"type": "const_string", "value": "\n</function>\n</tool_call>"},
        ],
    }


def tool_call_structure(tools: list[dict], fmt: Format) -> dict | None:
    """The structural-tag format of one call to one of ``tools`` in ``fmt``; None for a format without one."""
    if fmt.name == "qwen3_xml":
        calls = [_xml_call(t) for t in tools]
        return calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    key = "parameters" if fmt.name == "llama3_json" else "arguments"
    call = _one_of([_call_schema(t, key) for t in tools])
    one_call_list = {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
    if fmt.name in ("generic", "llama3_json"):
        return _json(call)
    if fmt.name == "hermes":
        return _sequence("<tool_call>", _json(call), "</tool_call>")
    if fmt.name == "nemotron":
        return _sequence("<TOOLCALL>", _json(one_call_list), "</TOOLCALL>")
    if fmt.name == "mistral":
        return {
            "type": "sequence",
            "elements": [{"type": "token", "token": "[TOOL_CALLS]"}, _json(one_call_list)],
        }
    return None


def _sequence(begin: str, body: dict, end: str) -> dict:
    # the markers sit on lines of their own in most templates; a newline around the body is optional
    newline = {"type": "regex", "pattern": "\\n?"}
    elements = [
        {"type": "const_string", "value": begin},
        newline,
        body,
        newline,
        {"type": "const_string", "value": end},
    ]
    return {"type": "sequence", "elements": elements}


def tool_call_guide(tools: list[dict], tool_choice: str | dict, fmt: Format) -> GuidedDecodingParams | None:
    """The guide that makes the model call one tool: any of ``tools`` for "required", the named one for
    {"type": "function", "function": {"name": ...}}; None when ``fmt`` has no structure to enforce."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
    structure = tool_call_structure(tools, fmt)
    if structure is None:
        return None
    return GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": structure})
