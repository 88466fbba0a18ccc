"""A tool conversation renders through the model's own chat template: the full prompt trtedge builds
equals transformers' rendering of the same conversation with the same template, whichever API it came
through. Bad Messages and Responses input is a 400 naming the part."""

from __future__ import annotations

import json

import pytest

from tests.server.scripted import make_scripted_checkpoint
from trtedge.server.app import build_app
from trtedge.server.chat_prompt import plan_chat
from trtedge.server.config import ServeConfig
from trtedge.server.openai.protocol import ChatCompletionRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def serving(model_dir, tmp_path_factory):
    from trtedge import LLM

    llm = LLM(
        str(model_dir),
        cache_dir=str(tmp_path_factory.getbasetemp() / "trtedge-cache"),
        max_kv_cache_capacity=512,
        max_input_len=256,
    )
    yield build_app(llm, ServeConfig(enable_auto_tool_choice=True)).state.serving
    llm.close()


def reference(model_dir, messages, tools) -> str:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    converted = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:  # transformers' convention: arguments as a mapping
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        converted.append(m)
    return tokenizer.apply_chat_template(converted, tools=tools, tokenize=False, add_generation_prompt=True)


def test_tool_conversation_prompt_matches_the_template(serving, model_dir):
    plan = plan_chat(
        serving, ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS})
    )
    expected = reference(model_dir, CONVERSATION, TOOLS)
    assert plan.prompt_text == expected
    assert '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>' in expected
    assert '"description": "The weather in a city"' in expected and expected.endswith("<answer> ")
    assert plan.choices[0].prompt == serving.llm.tokenizer.encode(expected, add_special_tokens=False)
    assert plan.tool_format.name == "hermes"  # auto: the template shows <tool_call>


def test_anthropic_and_responses_render_the_same_prompt(serving, model_dir):
    from trtedge.server.anthropic.protocol import MessagesRequest
    from trtedge.server.anthropic.translate import to_chat_request as from_anthropic
    from trtedge.server.responses.protocol import ResponsesRequest
    from trtedge.server.responses.translate import to_chat_request as from_responses

    expected = reference(model_dir, CONVERSATION, TOOLS)
    function = TOOLS[0]["function"]
    claude = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "tools": [
                {
                    "name": function["name"],
                    "description": function["description"],
                    "input_schema": function["parameters"],
                }
            ],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "call_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 24 C"}],
                },
            ],
        }
    )
    assert plan_chat(serving, from_anthropic(claude)).prompt_text == expected
    responses = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "tools": [{"type": "function", **function}],
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
            ],
        }
    )
    assert plan_chat(serving, from_responses(responses)).prompt_text == expected


@pytest.mark.parametrize(
    "path,body,status,where,text",
    [
        (
            "/v1/messages",
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
            400,
            "max_tokens",
            "required",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            400,
            "messages.0.content.0",
            "not supported",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search", "name": "w"}],
            },
            400,
            "tools.0.type",
            'the tool type "web_search"',
        ),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5},
            400,
            "temperature",
            "",
        ),
        ("/v1/responses", {"input": [{"type": "local_shell_call"}]}, 400, "input.0.type", "not supported"),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content.0.image_url",
            "no vision component",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                        ],
                    },
                ],
            },
            400,
            "messages.2.content.1.source",
            "no vision component",
        ),
        (
            "/v1/responses",
            {"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]},
            400,
            "tools.0.type",
            "function and namespace tools are served",
        ),
        ("/v1/responses", {"input": "x", "reasoning": {"effort": "max"}}, 400, "reasoning.effort", ""),
    ],
)
def test_bad_agent_requests_name_the_part(serving, path, body, status, where, text):
    import asyncio

    import httpx

    if path == "/v1/messages":
        body = {"model": serving.model_name, **body}

    async def main():
        app = build_app(serving.llm, ServeConfig(enable_auto_tool_choice=True))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    r = asyncio.run(main())
    assert r.status_code == status, r.text
    if path == "/v1/messages":
        error = r.json()["error"]
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
        assert where in error["message"] and text in error["message"]
    else:
        error = r.json()["error"]
        assert error["param"] == where and text in error["message"], error


def test_messages_stream_pings_while_the_model_is_busy(model_dir, tmp_path, monkeypatch):
    import asyncio

    from tests.server.asgi import call
    from trtedge import LLM

    monkeypatch.setenv("TRTEDGE_TEST_FAULT", "step_delay=0.01")  # every step takes 10 ms or more
    with LLM(
        str(model_dir), cache_dir=str(tmp_path / "c"), max_kv_cache_capacity=512, max_input_len=256
    ) as llm:
        app = build_app(llm, ServeConfig())
        app.state.anthropic.ping_seconds = 0.001  # far shorter than a step: pings while it runs
        body = {"model": app.state.serving.model_name, "max_tokens": 20, "stream": True}
        body["messages"] = [{"role": "user", "content": "count"}]
        reply = asyncio.run(call(app, "/v1/messages", body))
    names = [line[7:] for line in reply.body.decode().splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.count("ping") > 1  # one after message_start, more while waiting for tokens
    text = [json.loads(d)["delta"]["text"] for d in reply.events() if '"text_delta"' in d]
    assert "".join(text).split() == ["one"] * 20
