"""Chat completions tools, Anthropic Messages and OpenAI Responses end to end: `trtedge serve` on a
scripted tiny model (tests/server/scripted.py) whose greedy output is a hermes tool call when tools are
offered and "Sunny in Paris." after a tool result, driven by the official SDKs. The server wants an
API key: the anthropic SDK sends it as x-api-key, the openai SDK as a bearer token."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serve_process import ServeProcess
from tests.server.scripted import make_scripted_checkpoint

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "agents-key"
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
        "--enable-auto-tool-choice", "--served-model-name", "scripted", "--log-level", "warning", "--api-key", KEY,
    ]  # fmt: skip
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


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


def test_required_and_named_tool_choice_are_enforced(client, claude):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = client.chat.completions.create(
            model="scripted", messages=ASK, tools=[WEATHER_TOOL], tool_choice=choice, temperature=0
        )
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        m = claude.messages.create(
            model="scripted", max_tokens=64, messages=ASK, tools=[tool], tool_choice=choice
        )
        [use] = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.input["city"] and m.stop_reason == "tool_use"


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


# ---- Anthropic Messages ------------------------------------------------------------------------------
CLAUDE_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HI = [{"role": "user", "content": "hi"}]


def test_messages_text_usage_and_count_tokens(claude):
    r = claude.messages.create(model="scripted", max_tokens=20, messages=HI, system="Be brief.")
    assert r.type == "message" and r.role == "assistant" and r.model == "scripted"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip() == "Hello world"
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    counted = claude.messages.count_tokens(model="scripted", messages=HI, system="Be brief.")
    assert r.usage.input_tokens == counted.input_tokens > 0
    assert r.usage.output_tokens == 3  # Hello, world, end of sequence
    stopped = claude.messages.create(model="scripted", max_tokens=20, messages=HI, stop_sequences=["world"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "world"
    assert stopped.content[0].text.strip() == "Hello"
    short = claude.messages.create(model="scripted", max_tokens=1, messages=HI)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_messages_stream(claude, server):
    with claude.messages.stream(model="scripted", max_tokens=20, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() == "Hello world" and final.content[0].text == text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
    body = {"model": "scripted", "max_tokens": 20, "messages": HI, "stream": True}
    raw = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_messages_thinking_block(claude):
    r = claude.messages.create(
        model="scripted", max_tokens=20, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking.strip() == "hmm" and r.content[1].text == "Hello world"


def test_messages_tool_use_round_trip(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model="scripted", max_tokens=50, messages=ask, tools=[CLAUDE_TOOL])
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    with claude.messages.stream(model="scripted", max_tokens=50, messages=ask, tools=[CLAUDE_TOOL]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == {"city": "Paris"}
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}],
        },
    ]
    second = claude.messages.create(model="scripted", max_tokens=50, messages=history, tools=[CLAUDE_TOOL])
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"] and second.content[
        0
    ].text.strip() == "Sunny in Paris."


def test_messages_errors_in_anthropic_shape(claude, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="scripted", max_tokens=5, messages=[{"role": "user", "content": [image]}]
        )
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "no vision component" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="not-served", max_tokens=5, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_overload_is_529_overloaded_error(claude, server):
    # one request generates, none may queue (--max-queued-requests 0): the next is refused at once
    count = [{"role": "user", "content": "count"}]
    with claude.messages.stream(model="scripted", max_tokens=3000, messages=count) as busy:
        next(iter(busy.text_stream))
        with pytest.raises(anthropic.APIStatusError) as e:
            claude.messages.create(model="scripted", max_tokens=5, messages=HI)
    assert e.value.status_code == 529
    assert e.value.body["error"]["type"] == "overloaded_error"
    deadline = time.monotonic() + 30
    while server.health()["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the hang-up cancels the busy request; its seat comes back
    r = claude.messages.create(model="scripted", max_tokens=5, messages=HI)
    assert r.stop_reason == "end_turn"


# ---- OpenAI Responses --------------------------------------------------------------------------------
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_responses_create_plain_and_usage(client):
    r = client.responses.create(model="scripted", input="hi", instructions="Be brief.", max_output_tokens=20)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text.strip() == "Hello world"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.usage.output_tokens == 3 and r.usage.total_tokens == r.usage.input_tokens + 3
    short = client.responses.create(model="scripted", input="hi", max_output_tokens=1)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    thought = client.responses.create(model="scripted", input="hi", reasoning={"effort": "low"})
    assert [item.type for item in thought.output] == ["reasoning", "message"]
    assert thought.output[0].content[0].text.strip() == "hmm" and thought.output_text == "Hello world"


def test_responses_stream_events(client):
    events = list(client.responses.create(model="scripted", input="hi", max_output_tokens=20, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() == "Hello world" and events[-1].response.output_text == text
    with client.responses.stream(model="scripted", input="hi", max_output_tokens=20) as stream:
        final = stream.get_final_response()
    assert final.output_text.strip() == "Hello world"


def test_responses_function_call_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="scripted", input=ask, tools=[RESPONSES_TOOL])
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    streamed = list(client.responses.create(model="scripted", input=ask, tools=[RESPONSES_TOOL], stream=True))
    fragments = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == {"city": "Paris"}
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(fragments)
    history = [
        *ask,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"},
    ]
    second = client.responses.create(model="scripted", input=history, tools=[RESPONSES_TOOL])
    assert second.output_text.strip() == "Sunny in Paris." and second.status == "completed"


def test_responses_refuse_previous_response_id(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "does not store" in e.value.body["message"]
