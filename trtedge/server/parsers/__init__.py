"""Tool-call and reasoning parsers, chosen by --tool-call-parser and --reasoning-parser.

Tool-call formats (what each name reads):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen2.5, Qwen3)
  qwen3_xml    <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>  (Qwen3-Coder)
  llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]  (Llama 3.1-3.3)
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}] or [TOOL_CALLS]NAME[ARGS]{...}
  nemotron     <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>  (Llama-Nemotron)
  generic      an output that is a JSON call object or a JSON array of them
  openai       harmony (gpt-oss): <|channel|>commentary to=functions.NAME ... <|message|>{...}<|call|>

Reasoning: qwen3, deepseek_r1, nemotron split <think>...</think>; openai reads harmony's analysis channel.
"""

from __future__ import annotations

from trtedge.server.parsers.formats import FORMATS, Format
from trtedge.server.parsers.guides import tool_call_guide
from trtedge.server.parsers.output import OutputParser, ParsedOutput
from trtedge.server.parsers.reasoning import HARMONY, STARTS_IN_REASONING
from trtedge.server.parsers.tool_calls import ToolCall, parse_tool_calls

TOOL_CALL_PARSERS = ("auto", *FORMATS)
REASONING_PARSERS = ("auto", "none", *STARTS_IN_REASONING, HARMONY)


def detect_tool_format(template: str) -> str:
    """The tool-call format a chat template teaches its model (``generic`` when it shows none)."""
    if "<|channel|>" in template:
        return "openai"
    if "<tool_call>" in template:
        return "qwen3_xml" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<TOOLCALL>" in template:
        return "nemotron"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "generic"


def tool_format(parser: str, template: str) -> Format:
    return FORMATS[detect_tool_format(template) if parser == "auto" else parser]


def reasoning_parser(parser: str, template: str) -> str | None:
    """The reasoning parser to use, or None: ``auto`` picks qwen3 for a template that knows <think>."""
    if parser == "auto":
        if "<|channel|>" in template:
            return HARMONY
        return "qwen3" if "<think>" in template or "</think>" in template else None
    return None if parser == "none" else parser


__all__ = [
    "FORMATS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "Format",
    "OutputParser",
    "ParsedOutput",
    "ToolCall",
    "detect_tool_format",
    "parse_tool_calls",
    "reasoning_parser",
    "tool_call_guide",
    "tool_format",
]
