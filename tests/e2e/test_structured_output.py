"""Structured output through `trtedge serve` and the official openai SDK: response_format json_schema
(streaming and not), guided_decoding kinds, and the 400s for guides that cannot be enforced."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest

from tests.guided_schemas import PROMPT, SCHEMAS
from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [
        "--max-kv-cache-capacity", "1024", "--max-input-len", "512", "--enable-in-flight-batching",
        "--max-batch-size", "8", "--log-level", "warning",
    ]  # fmt: skip
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


MODEL = "SmolLM2-135M-Instruct"


def schema_answer(client, name: str, seed: int, stream: bool) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    kwargs = dict(
        model=MODEL, messages=PROMPT, response_format=fmt, max_tokens=96, temperature=1.0, seed=seed
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop"
        return choice.message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def check_schemas(client, seeds) -> int:
    jobs = [(name, seed, stream) for name in SCHEMAS for seed in seeds for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda job: schema_answer(client, *job), jobs))
    for (name, _, _), text in zip(jobs, texts):
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    return len(texts)


def test_json_schema_answers_validate_streaming_and_not(client):
    # every schema, streamed and not, one seed each (the slow test below draws 20 seeds)
    assert check_schemas(client, range(1)) == 10


@pytest.mark.slow
def test_json_schema_answers_validate_20_seeds(client):
    assert check_schemas(client, range(20)) == 200


@pytest.mark.parametrize(
    ("guide", "pattern"),
    [
        ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, r"[0-9]{3}-[a-z]{2,5}"),
        ({"choice": ["sunny", "rainy"]}, r"sunny|rainy"),
        ({"grammar": 'root ::= "(" [a-z]+ ")"'}, r"\([a-z]+\)"),
    ],
)
def test_guided_decoding_kinds_on_chat_and_completions(client, guide, pattern):
    chat = client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=32, temperature=0, extra_body={"guided_decoding": guide}
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    completion = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=32,
        temperature=0,
        extra_body={"guided_decoding": guide},
    )
    assert re.fullmatch(pattern, completion.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_decoding": {"regex": "a"}},
            "guided_decoding",
            "only one",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "'uniqueItems'",
        ),
        ({"guided_decoding": {"json": {"type": "string", "format": "int32"}}}, "guided_decoding", "'format'"),
        ({"guided_decoding": {"regex": "(a"}}, "guided_decoding", "invalid regex guide"),
        ({"guided_decoding": {"grammar": "root ::= nope"}}, "guided_decoding", "not defined"),
        (
            {"guided_decoding": {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
            "guided_decoding",
            "invalid json guide",
        ),
        ({"guided_decoding": {"regex": "a" * (128 * 1024 + 1)}}, "guided_decoding", "at most 131072"),
        ({"guided_decoding": {"regex": "a", "choice": ["b"]}}, "guided_decoding", "exactly one"),
        ({"guided_decoding": {"pattern": "a"}}, "guided_decoding.pattern", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ],
)
def test_guides_that_cannot_be_enforced_are_400(server, extra, param, text):
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert server.health()["status"] == "ok"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_returns_a_call_whose_arguments_validate(client, stream):
    ask = [{"role": "user", "content": "Will it rain in Lisbon this week?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=ask, tools=[ADD, WEATHER], tool_choice=named, seed=seed)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
            name = "".join(d.function.name or "" for d in deltas)
            arguments = "".join(d.function.arguments or "" for d in deltas)
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_responses_text_format_json_schema(client):
    schema = SCHEMAS["enum"]
    fmt = {"type": "json_schema", "name": "mood", "schema": schema, "strict": True}
    r = client.responses.create(model=MODEL, input="How do you feel?", text={"format": fmt}, temperature=0)
    jsonschema.validate(json.loads(r.output_text), schema)
