"""Tool-call and reasoning parsers: every format whole and streamed, text cut at every boundary."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtedge.server.parsers import FORMATS, OutputParser, ToolCall, detect_tool_format, parse_tool_calls
from trtedge.server.parsers.output import merge

WEATHER = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
}
PARIS = '{"city": "Paris", "days": 3}'

# (format, output, expected content, expected calls)
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + "}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {"q": "a \\"}\\" b"}, "name": "search"}</tool_call>\nDone.',
        "\nDone.",
        [ToolCall("search", '{"q": "a \\"}\\" b"}')],
    ),
    (
        "qwen3_xml",
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Sure.\n",
        [ToolCall("get_weather", PARIS)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + PARIS
        + '}; {"name": "get_time", "parameters": {}}',
        "",
        [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": ' + PARIS + "}",
        "",
        [ToolCall("get_weather", PARIS)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": '
        + PARIS
        + '}, {"name": "get_time", "arguments": {}}]',
        "",
        [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")],
    ),
    (
        "mistral",
        "Checking.[TOOL_CALLS]get_weather[ARGS]" + PARIS + "[TOOL_CALLS]get_time[ARGS]{}",
        "Checking.",
        [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")],
    ),
    (
        "nemotron",
        '<TOOLCALL>[{"name": "get_weather", "arguments": ' + PARIS + "}]</TOOLCALL>",
        "",
        [ToolCall("get_weather", PARIS)],
    ),
    (
        "generic",
        '[{"name": "get_weather", "arguments": ' + PARIS + '}, {"name": "get_time", "arguments": "{}"}]',
        "",
        [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")],
    ),
    ("generic", "The capital is Paris. {not a call}", "The capital is Paris. {not a call}", []),
    (
        "openai",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>" + PARIS + "<|call|>",
        "",
        [ToolCall("get_weather", PARIS)],
    ),
    ("openai", "<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny.", []),
]

MALFORMED = [
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>"),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1'),
    ("mistral", "[TOOL_CALLS]nonsense"),
    ("nemotron", "<TOOLCALL>[]</TOOLCALL>"),
    ("generic", '{"name": 3}'),
]


def stream(fmt: str, pieces: list[str], reasoning: str | None = None, opened: bool = False):
    parser = OutputParser(reasoning, FORMATS[fmt] if fmt else None, WEATHER, opened)
    events = []
    for k, piece in enumerate(pieces):
        events += parser.feed(piece, final=k == len(pieces) - 1)
    return events


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_output(fmt, text, content, calls):
    assert parse_tool_calls(FORMATS[fmt], text, WEATHER) == (content, calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streamed_at_every_boundary(fmt, text, content, calls):
    # every two-piece cut, and one character at a time
    for cut in range(len(text) + 1):
        out = merge(stream(fmt, [text[:cut], text[cut:]]))
        assert (out.content, out.calls) == (content, calls), cut
    events = stream(fmt, [*text, ""])
    out = merge(events)
    assert (out.content, out.calls) == (content, calls)
    heads = [e for e in events if e[0] == "call"]
    assert [(e[1], e[2]) for e in heads] == [(i, c.name) for i, c in enumerate(calls)]
    for i in range(len(calls)):
        # the head comes before the call's first argument fragment
        first = next(k for k, e in enumerate(events) if e[0] == "call" and e[1] == i)
        assert all(k > first for k, e in enumerate(events) if e[0] == "arguments" and e[1] == i)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_at_random_boundaries(data):
    fmt, text, content, calls = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = merge(stream(fmt, pieces))
    assert (out.content, out.calls) == (content, calls)


def test_plain_text_streams_as_it_comes():
    events = stream("hermes", ["The answer", " is 4", "", " <tool", "_c", "x> done", ""])
    contents = [e[1] for e in events]
    assert contents[:2] == ["The answer", " is 4"]  # not held back when nothing looks like a call
    assert "".join(contents) == "The answer is 4 <tool_cx> done"


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_text_falls_back_to_content(fmt, text):
    assert parse_tool_calls(FORMATS[fmt], text, WEATHER) == (text, [])
    for cut in range(len(text) + 1):
        stream(fmt, [text[:cut], text[cut:]])  # never raises


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    text=st.text(alphabet='<>{}[]"\\:,; \nabc_=/TOOLCALSnmerg', max_size=60),
)
def test_arbitrary_text_never_raises(fmt, text):
    content, calls = parse_tool_calls(FORMATS[fmt], text, WEATHER)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
    stream(fmt, list(text) + [""])


REASONING = [
    ("qwen3", False, "<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", "\nLet me see: 2 < 3.\n", "Yes."),
    ("qwen3", False, "No thinking here.", "", "No thinking here."),
    ("qwen3", True, "in the prompt</think>Answer", "in the prompt", "Answer"),
    ("deepseek_r1", False, "reasoning first</think>\n\nAnswer", "reasoning first", "Answer"),
    ("deepseek_r1", False, "<think>cut short", "cut short", ""),
    ("nemotron", False, "<think>a</think>b", "a", "b"),
    (
        "openai",
        False,
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>",
        "a",
        "b",
    ),
]


@pytest.mark.parametrize("parser,opened,text,reasoning,content", REASONING)
def test_reasoning_whole_and_streamed(parser, opened, text, reasoning, content):
    for cut in range(len(text) + 1):
        out = merge(stream("", [text[:cut], text[cut:]], parser, opened))
        assert (out.reasoning, out.content) == (reasoning, content), cut
    out = merge(stream("", [*text, ""], parser, opened))
    assert (out.reasoning, out.content) == (reasoning, content)


def test_reasoning_then_tool_call():
    text = '<think>I should look it up.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    for cut in range(len(text) + 1):
        out = merge(stream("hermes", [text[:cut], text[cut:]], "qwen3"))
        assert out.reasoning == "I should look it up."
        assert out.calls == [ToolCall("get_weather", '{"city": "Rome"}')] and out.content == ""


@pytest.mark.parametrize(
    "template,fmt",
    [
        ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
        ("<tool_call>\n<function=example>", "qwen3_xml"),
        ("[AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
        ("<TOOLCALL>", "nemotron"),
        ("<|python_tag|> ipython", "llama3_json"),
        ("<|start|>assistant<|channel|>final<|message|>", "openai"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
    ],
)
def test_auto_format_from_the_template(template, fmt):
    assert detect_tool_format(template) == fmt
