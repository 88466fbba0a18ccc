"""Tool calling end to end: `trtedge serve` on a scripted tiny model (tests/server/scripted.py) whose
greedy output is a hermes tool call when tools are offered and "Sunny in Paris." after a tool result,
driven by the official SDKs."""

from __future__ import annotations

import json

import pytest

from tests.serve_process import ServeProcess
from tests.server.scripted import make_scripted_checkpoint

openai = pytest.importorskip("openai")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model")
    args = [
        str(model), "--max-kv-cache-capacity", "4096", "--max-input-len", "2048", "--max-queued-requests", "0",
        "--enable-auto-tool-choice", "--served-model-name", "scripted", "--log-level", "warning",
    ]  # fmt: skip
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_tool_call_round_trip(client):
    first = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER_TOOL], temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    second = client.chat.completions.create(
        model="scripted", messages=history, tools=[WEATHER_TOOL], temperature=0
    )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content.strip() == "Sunny in Paris."
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_chat_tool_call_streamed_as_indexed_deltas(client):
    stream = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER_TOOL], temperature=0, stream=True
    )
    calls, finish, content = [], None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content.strip() == ""
    head, *fragments = calls
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    assert len(fragments) >= 2  # the arguments arrive as they are generated
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    arguments = head.function.arguments + "".join(f.function.arguments for f in fragments)
    assert json.loads(arguments) == {"city": "Paris"}


def test_tool_choice_none_answers_text(client):
    r = client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER_TOOL], tool_choice="none", temperature=0
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert "<tool_call>" in r.choices[0].message.content  # not parsed when the model may not call tools


def test_required_tool_choice_needs_structured_output(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="scripted", messages=ASK, tools=[WEATHER_TOOL], tool_choice="required"
        )
    assert "structured output" in str(e.value)


def test_reasoning_is_split_when_thinking_is_on(client):
    hello = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="scripted", messages=hello, temperature=0)
    assert plain.choices[0].message.content.strip() == "Hello world"
    r = client.chat.completions.create(
        model="scripted", messages=hello, temperature=0, extra_body={"enable_thinking": True}
    )
    message = r.choices[0].message
    assert message.reasoning_content.strip() == "hmm" and message.content == "Hello world"
    stream = client.chat.completions.create(
        model="scripted",
        messages=hello,
        temperature=0,
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    kinds = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for kind in ("reasoning_content", "content"):
            if getattr(delta, kind, None):
                kinds.append((kind, getattr(delta, kind)))
    assert "".join(t for k, t in kinds if k == "reasoning_content").strip() == "hmm"
    assert "".join(t for k, t in kinds if k == "content") == "Hello world"
    assert kinds[0][0] == "reasoning_content" and kinds[-1][0] == "content"
