"""What the coding-agent CLIs send, on the wire (issue 23): Claude Code's system turns inside
``messages``, its Anthropic-worded context errors, its extra fields and its probe of ``/``; Codex's
namespace tool groups and hosted tools; tools for a chat template that shows none; and
--override-generation-config. A scripted tiny model makes every answer known in advance."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tests.server.scripted import make_scripted_checkpoint
from trtedge.server.app import build_app
from trtedge.server.chat_prompt import plan_chat
from trtedge.server.config import ServeConfig, ServerConfigError
from trtedge.server.openai.protocol import ChatCompletionRequest

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
# A template that shows no tools (like both embedded models'); it starts a call when the system
# prompt teaches one, so that the scripted model answers with the generic JSON format.
NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}{% if 'You can call the tools below' in messages[0].content %}"
    "<tool_call> {% else %}<reply> {% endif %}{% endif %}"
)
# Gemma's way: the system prompt folded into the first user turn, no system turn of its own.
FOLDING_TEMPLATE = (
    "{% set sys = messages[0].content + ' | ' if messages[0].role == 'system' else '' %}"
    "{% for m in (messages[1:] if sys else messages) %}<{{ m.role }}> {{ sys if loop.first else '' }}"
    "{{ m.content }} {% endfor %}{% if add_generation_prompt %}<reply> {% endif %}"
)
# A template that refuses a system message anywhere but first (as Gemma's and Llama 2's do).
SYSTEM_FIRST_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system messages must come first') }}{% endif %}"
    "<{{ m.role }}> {{ m.content }} {% endfor %}{% if add_generation_prompt %}<reply> {% endif %}"
)


def _checkpoint(tmp_path_factory, name: str, template: str | None = None):
    directory = make_scripted_checkpoint(tmp_path_factory.mktemp(name) / "model")
    if template is not None:
        config = directory / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
    return directory


def _llm(tmp_path_factory, directory):
    from trtedge import LLM

    return LLM(
        str(directory),
        cache_dir=str(tmp_path_factory.getbasetemp() / "trtedge-cache"),
        max_kv_cache_capacity=512,
        max_input_len=256,
    )


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    llm = _llm(tmp_path_factory, _checkpoint(tmp_path_factory, "scripted"))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def no_tools(tmp_path_factory):
    llm = _llm(tmp_path_factory, _checkpoint(tmp_path_factory, "no-tools", NO_TOOLS_TEMPLATE))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def system_first(tmp_path_factory):
    llm = _llm(tmp_path_factory, _checkpoint(tmp_path_factory, "system-first", SYSTEM_FIRST_TEMPLATE))
    yield llm
    llm.close()


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())


def app_for(llm, **config):
    return build_app(llm, ServeConfig(enable_auto_tool_choice=True, **config))


def message(**body):
    return {"model": "m", "max_tokens": 16, **body}


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


# Claude Code ---------------------------------------------------------------------------------------


def test_a_system_message_inside_messages_is_a_system_turn(scripted):
    from trtedge.server.anthropic.protocol import MessagesRequest
    from trtedge.server.anthropic.translate import to_chat_request

    app = app_for(scripted, served_model_name="m")
    body = message(
        system="Be brief.",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment: linux"}]},
        ],
    )
    response = request(app, "POST", "/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"].strip() == "Hello world"
    chat = to_chat_request(MessagesRequest.model_validate(body))
    text = plan_chat(app.state.serving, chat).prompt_text
    assert text == "<system> Be brief. <user> hi <system> # Environment: linux <reply> "


def test_a_template_that_wants_system_first_gets_later_system_messages_merged(system_first):
    app = app_for(system_first, served_model_name="m")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Env: linux"},
    ]
    plan = plan_chat(app.state.serving, ChatCompletionRequest.model_validate({"messages": messages}))
    assert plan.prompt_text == "<system> Be brief.\n\nEnv: linux <user> hi <reply> "
    response = request(app, "POST", "/v1/messages", json=message(messages=messages[1:], system="Be brief."))
    assert response.status_code == 200, response.text


def test_a_template_without_system_turns_gets_later_system_messages_merged(tmp_path_factory):
    llm = _llm(tmp_path_factory, _checkpoint(tmp_path_factory, "folding", FOLDING_TEMPLATE))
    try:
        app = app_for(llm)
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Env: linux"},
        ]
        plan = plan_chat(app.state.serving, ChatCompletionRequest.model_validate({"messages": messages}))
        assert plan.prompt_text == "<user> Be brief.\n\nEnv: linux | hi <reply> "
    finally:
        llm.close()


def test_claude_codes_extra_fields_are_accepted(scripted, caplog):
    body = message(
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "adaptive", "display": "omitted"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        stream=True,
    )
    response = request(app_for(scripted, served_model_name="m"), "POST", "/v1/messages?beta=true", json=body)
    assert response.status_code == 200, response.text
    kinds = [e["type"] for e in events(response)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_over_long_input_is_worded_as_anthropic_words_it(scripted):
    app = app_for(scripted, served_model_name="m")
    body = message(messages=[{"role": "user", "content": "hi"}], max_tokens=600)
    error = request(app, "POST", "/v1/messages", json=body).json()
    n = request(app, "POST", "/v1/messages/count_tokens", json={k: body[k] for k in ("model", "messages")})
    n = n.json()["input_tokens"]
    assert error == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"input length and `max_tokens` exceed context limit: {n} + 600 > 512, "
            "decrease input length or `max_tokens` and try again",
        },
    }
    long = message(messages=[{"role": "user", "content": "w5 " * 300}])
    response = request(app, "POST", "/v1/messages", json=long)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("prompt is too long: ")
    assert response.json()["error"]["message"].endswith(" tokens > 256 maximum")


def test_the_openai_routes_keep_context_length_exceeded(scripted):
    app = app_for(scripted)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
    error = request(app, "POST", "/v1/chat/completions", json=body).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "max_kv_cache_capacity 512" in error["message"]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_the_root_answers_a_short_200_without_a_key(scripted, method):
    response = request(app_for(scripted, api_key="k"), method, "/")
    assert response.status_code == 200
    assert response.text == ("" if method == "HEAD" else f"trtedge serve: {scripted.model_name}\n")


# Codex -------------------------------------------------------------------------------------------

NAMESPACE = {
    "type": "namespace",
    "name": "weather_v1",
    "description": "Weather tools",
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "strict": False,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
}


def test_a_namespace_groups_functions_are_shown_as_namespace_dot_name(scripted):
    from trtedge.server.responses.protocol import ResponsesRequest
    from trtedge.server.responses.translate import to_chat_request

    app = app_for(scripted)
    history = {
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "namespace": "weather_v1",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": [NAMESPACE],
    }
    chat = to_chat_request(ResponsesRequest.model_validate(history))
    text = plan_chat(app.state.serving, chat).prompt_text
    assert '"name": "weather_v1.get_weather", "description": "The weather in a city"' in text
    assert (
        '<tool_call> {"name": "weather_v1.get_weather", "arguments": {"city": "Paris"}} </tool_call>' in text
    )
    answer = request(app, "POST", "/v1/responses", json={**history, "stream": True})
    assert answer.status_code == 200, answer.text
    done = events(answer)[-1]
    assert done["type"] == "response.completed"
    assert done["response"]["output"][0]["content"][0]["text"].strip() == "Sunny in Paris."
    assert done["response"]["tools"] == [NAMESPACE]


def test_a_call_to_a_namespaced_function_names_it_as_the_responses_api_does(scripted):
    from trtedge.server.responses.serving import _Items

    items = _Items({"weather_v1.get_weather": ("weather_v1", "get_weather")})
    items.add(("call", 0, "weather_v1.get_weather"))
    items.add(("arguments", 0, '{"city": "Paris"}'))
    items.close()
    [call] = items.done
    assert (call["type"], call["namespace"], call["name"]) == ("function_call", "weather_v1", "get_weather")
    assert call["arguments"] == '{"city": "Paris"}'


def test_hosted_tools_are_left_out_of_the_prompt_and_logged_once(scripted, caplog):
    from trtedge.server.responses import translate

    translate._skipped.discard("web_search")
    app = app_for(scripted)
    body = {"input": "hi", "tools": [{"type": "web_search", "external_web_access": False}]}
    with caplog.at_level(logging.INFO, logger="trtedge.server"):
        for _ in range(2):
            response = request(app, "POST", "/v1/responses", json=body)
            assert response.status_code == 200, response.text
            # no tools left: the scripted model replies instead of calling
            assert response.json()["output"][0]["content"][0]["text"].strip() == "Hello world"
    assert sum("'web_search'" in r.getMessage() for r in caplog.records) == 1
    other = request(app, "POST", "/v1/responses", json={"input": "hi", "tools": [{"type": "local_shell"}]})
    assert other.status_code == 400 and other.json()["error"]["param"] == "tools.0.type"


def test_anthropics_versioned_tools_are_left_out_of_the_prompt_and_logged_once(scripted, caplog):
    from trtedge.server.anthropic import translate
    from trtedge.server.anthropic.protocol import MessagesRequest

    translate._skipped.clear()
    app = app_for(scripted, served_model_name="m")
    server_tools = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
    ]
    body = message(messages=[{"role": "user", "content": "hi"}], tools=server_tools)
    with caplog.at_level(logging.INFO, logger="trtedge.server"):
        for _ in range(2):
            response = request(app, "POST", "/v1/messages", json=body)
            assert response.status_code == 200, response.text
            # no tools left: the scripted model replies instead of calling
            assert [(b["type"], b["text"].strip()) for b in response.json()["content"]] == [
                ("text", "Hello world")
            ]
        forged = {"type": "web_search_20250305\nINFO forged line", "name": "w"}
        refused = request(app, "POST", "/v1/messages", json={**body, "tools": [forged]})
    lines = [r.getMessage() for r in caplog.records if "defined by Anthropic" in r.getMessage()]
    assert len(lines) == 2 and "'web_search_20250305'" in lines[0] and "'bash_20250124'" in lines[1]
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    assert all("\n" not in r.getMessage() for r in caplog.records)
    custom = {"type": "custom", "name": "w", "input_schema": {"type": "object"}}
    chat = translate.to_chat_request(
        MessagesRequest.model_validate({**body, "tools": [server_tools[0], custom]})
    )
    assert [t["function"]["name"] for t in chat.tools] == ["w"]


def _flat(name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }


# Tools for a template that shows none ------------------------------------------------------------


def test_tools_go_into_the_system_prompt_when_the_template_shows_none(no_tools, caplog):
    app = app_for(no_tools, served_model_name="m")
    chat = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [_flat("get_weather")]}
    plan = plan_chat(app.state.serving, ChatCompletionRequest.model_validate(chat))
    assert plan.prompt_text.startswith("<system> You can call the tools below.")
    assert '{"name": "get_weather", "description": "", "parameters": {"type": "object"' in plan.prompt_text
    assert plan.tool_format.name == "generic"
    body = message(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        stop_sequences=["</tool_call>"],
        max_tokens=32,
    )
    response = request(app, "POST", "/v1/messages", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["stop_reason"] == "tool_use"
    [call] = [b for b in answer["content"] if b["type"] == "tool_use"]
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})


def test_earlier_calls_and_results_are_shown_as_text_to_such_a_template(no_tools):
    app = app_for(no_tools)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat = ChatCompletionRequest.model_validate({"messages": messages, "tools": [_flat("get_weather")]})
    text = plan_chat(app.state.serving, chat).prompt_text
    assert text.startswith("<system> Be brief.\n\nYou can call the tools below.")
    assert '<assistant> {"name": "get_weather", "arguments": {"city": "Paris"}} ' in text
    assert '<user> {"tool_result": {"call_id": "c1", "content": "sunny"}} ' in text


def test_a_template_that_shows_tools_gets_them_as_before(scripted):
    app = app_for(scripted)
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [_flat("get_weather")]}
    plan = plan_chat(app.state.serving, ChatCompletionRequest.model_validate(chat))
    assert plan.prompt_text.startswith("<tools> [")
    assert "You can call the tools below" not in plan.prompt_text


# --override-generation-config --------------------------------------------------------------------


def test_generation_defaults_apply_where_the_request_is_silent(scripted):
    app = app_for(scripted, override_generation_config='{"temperature": 0, "max_new_tokens": 3}')
    count = {"messages": [{"role": "user", "content": "count"}]}  # the scripted model counts forever
    answer = request(app, "POST", "/v1/chat/completions", json=count).json()
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "length"
    more = request(app, "POST", "/v1/chat/completions", json={**count, "max_tokens": 5}).json()
    assert more["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    "text, wording",
    [
        ("[1]", "must be a JSON object"),
        ("{", "must be a JSON object"),
        ('{"temp": 0}', "unknown key 'temp'"),
        ('{"top_k": 1.5}', "top_k must be an integer"),
        ('{"max_new_tokens": 0}', "max_new_tokens must be a positive integer"),
    ],
)
def test_a_bad_generation_config_names_the_flag(text, wording):
    with pytest.raises(ServerConfigError, match="--override-generation-config") as e:
        ServeConfig(override_generation_config=text)
    assert wording in str(e.value)
