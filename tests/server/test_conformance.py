"""Conformance with the OpenAI and Anthropic references, in-process on the embedded model with context
reuse on, driven by the official SDKs (their strict types) where they apply: required response fields
with true values, Anthropic output_config, the OpenAPI document against the server, request data
escaped in the log."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tests.server.asgi import call
from tests.server.conftest import load_llm
from trtedge.llm import structured_output_available
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")  # the SDKs' own HTTP client

CHAT = "/v1/chat/completions"
# Long enough for three full 16-token KV blocks: a repeat reuses them from the context cache.
LONG = "Here is some background on French geography and history. " * 8 + "What is the capital of France?"
ASK = [{"role": "user", "content": LONG}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = load_llm(tmp_path_factory, context_cache_config={"enabled": True})
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ServeConfig(served_model_name="m"))


def post(app, path: str, body: dict, **kwargs) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.post(path, json=body, **kwargs)

    return asyncio.run(main())


def with_sdk(app, kind: str, use):
    """``use(client)`` with the official async SDK client of ``kind`` talking to ``app`` in-process."""

    async def main():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://testserver")
        if kind == "openai":
            client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="-", http_client=http)
        else:
            client = anthropic.AsyncAnthropic(base_url="http://testserver", api_key="-", http_client=http)
        async with http:
            return await use(client)

    return asyncio.run(main())


# ---- required response fields, true values ------------------------------------------------------
def test_responses_usage_has_the_fields_the_sdk_requires_and_counts_reused_tokens(app):
    async def twice(client):
        return [
            await client.responses.create(
                model="m", instructions="Be brief.", input=LONG, max_output_tokens=2, temperature=0
            )
            for _ in range(2)
        ]

    cold, warm = with_sdk(app, "openai", twice)
    for r in (cold, warm):
        details = r.usage.input_tokens_details
        assert details.cache_write_tokens == 0
        assert r.usage.input_tokens == cold.usage.input_tokens > 48
    assert cold.usage.input_tokens_details.cached_tokens == 0
    reused = warm.usage.input_tokens_details.cached_tokens
    assert reused > 0 and reused % 16 == 0 and reused < warm.usage.input_tokens  # whole blocks, not the last


def test_chat_message_has_refusal_and_usage_reports_cached_tokens(app):
    body = {"model": "m", "messages": ASK, "max_tokens": 2, "temperature": 0}
    cold, warm = post(app, CHAT, body).json(), post(app, CHAT, body).json()
    assert "refusal" in cold["choices"][0]["message"] and cold["choices"][0]["message"]["refusal"] is None
    assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    async def streamed(client):
        stream = await client.chat.completions.create(
            model="m", messages=ASK, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in stream]

    chunks = with_sdk(app, "openai", streamed)
    assert chunks[0].choices[0].delta.refusal is None and chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert (
        usage.prompt_tokens_details.cached_tokens == warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def test_anthropic_usage_reports_context_reuse_as_cache_reads(app):
    # a system prompt of its own: no other test's prompt shares its first block
    ask = {
        "model": "m",
        "max_tokens": 2,
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": LONG}],
    }

    async def run(client):
        cold = await client.messages.create(**ask)
        warm = await client.messages.create(**ask)
        async with client.messages.stream(**ask) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_message()
        return cold, warm, events, final

    cold, warm, events, final = with_sdk(app, "anthropic", run)
    total = cold.usage.input_tokens
    assert cold.usage.cache_read_input_tokens == 0 and cold.usage.cache_creation_input_tokens == 0
    assert cold.stop_details is None and warm.stop_details is None
    read = warm.usage.cache_read_input_tokens
    assert read > 0 and warm.usage.input_tokens + read == total  # input_tokens: the tokens not read
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == total  # not known yet at the start: all counted as input
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.cache_read_input_tokens == read and delta.usage.input_tokens == total - read
    assert final.usage.cache_read_input_tokens == read and final.usage.input_tokens == total - read
    assert final.stop_details is None


# ---- Anthropic output_config ---------------------------------------------------------------------
@pytest.mark.skipif(not structured_output_available(), reason="structured output needs xgrammar")
def test_anthropic_messages_parse_gets_json_matching_the_schema(app):
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        country: str

    async def parse(client):
        return await client.messages.parse(
            model="m",
            max_tokens=40,
            messages=[{"role": "user", "content": "Name a city in France as JSON."}],
            output_format=City,
        )

    parsed = with_sdk(app, "anthropic", parse)
    assert isinstance(parsed.parsed_output, City)
    assert parsed.stop_reason == "end_turn"  # the grammar ended the answer, not max_tokens


@pytest.mark.skipif(not structured_output_available(), reason="structured output needs xgrammar")
def test_anthropic_output_format_errors_name_the_anthropic_field(app):
    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    bad = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "no-such"}}}}
    r = post(app, "/v1/messages", {**base, "output_config": {"format": bad}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("output_config.format: ")
    both = {**base, "output_config": {"format": bad}, "output_format": bad}
    assert "not both" in post(app, "/v1/messages", both).json()["error"]["message"]
    r = post(app, "/v1/messages", {**base, "output_config": {"effort": "extreme"}})
    assert r.status_code == 400 and "output_config.effort" in r.json()["error"]["message"]


def test_anthropic_effort_and_adaptive_thinking_reach_the_template_as_reasoning_effort(app, monkeypatch):
    serving = app.state.serving
    seen = []
    real = serving.llm.tokenizer.apply_chat_template

    def spy(messages, **options):
        if any("trtedge-probe" in str(m.get("content")) for m in messages):  # the system-turn probe
            return real(messages, **options)
        seen.append((options.get("enable_thinking"), options.get("reasoning_effort")))
        return real(messages, **options)

    monkeypatch.setattr(serving.llm.tokenizer, "apply_chat_template", spy)
    base = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for extra in (
        {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}},  # what Claude Code sends
        {"output_config": {"effort": "max"}},
        {"output_config": {"effort": "low"}, "thinking": {"type": "disabled"}},
        {},
    ):
        assert post(app, "/v1/messages", {**base, **extra}).status_code == 200
    assert post(app, "/v1/messages/count_tokens", {**base, "output_config": {"effort": "medium"}}).is_success
    assert seen == [(True, "high"), (None, "high"), (False, "low"), (None, None), (None, "medium")]


# ---- the OpenAPI document and the server agree --------------------------------------------------
def test_openapi_declares_api_key_security_only_when_the_server_checks_a_key(llm):
    open_doc = _get(llm, ServeConfig())
    assert "securitySchemes" not in open_doc["components"]
    operations = [op for item in open_doc["paths"].values() for op in item.values() if isinstance(op, dict)]
    assert operations and all("security" not in op and "401" not in op["responses"] for op in operations)
    keyed = _get(llm, ServeConfig(api_key="k"))
    assert set(keyed["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert keyed["paths"][CHAT]["post"]["security"] and "401" in keyed["paths"][CHAT]["post"]["responses"]
    assert "security" not in keyed["paths"]["/health"]["get"]


def _get(llm, config) -> dict:
    async def main():
        transport = httpx.ASGITransport(app=build_app(llm, config))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return (await client.get("/openapi.json")).json()

    return asyncio.run(main())


def test_a_tool_message_needs_tool_call_id_in_the_document_and_the_server(app, llm):
    jsonschema = pytest.importorskip("jsonschema")
    doc = _get(llm, ServeConfig())
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/ChatCompletionRequest", "components": doc["components"]}
    )
    call_ = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call_]},
        {"role": "tool", "content": "42"},
    ]
    body = {"model": "m", "messages": history, "max_tokens": 2}
    assert not validator.is_valid(body)
    r = post(app, CHAT, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.tool_call_id"
    history[2]["tool_call_id"] = "c1"
    assert validator.is_valid(body) and post(app, CHAT, body).status_code == 200


def test_an_empty_completion_prompt_is_served_from_the_start_of_a_document(app, llm):
    for prompt in ("", [[]], ["", "Paris is"]):
        r = post(app, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (
            body["choices"][0]["finish_reason"] in ("length", "stop") and body["usage"]["prompt_tokens"] >= 1
        )
    one = post(app, "/v1/completions", {"model": "m", "prompt": "", "max_tokens": 3}).json()
    assert one["usage"]["prompt_tokens"] == 1  # the BOS token alone
    r = post(app, "/v1/completions", {"model": "m", "prompt": [], "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_integral_floats_are_integers_as_json_schema_says(app):
    msg = {"model": "m", "max_tokens": 3.0, "messages": [{"role": "user", "content": "hi"}], "top_k": 5.0}
    r = post(app, "/v1/messages", msg)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= 3
    r = post(app, "/v1/messages", {**msg, "max_tokens": 349.0, "stop_sequences": [" ", "\n"]})
    assert r.status_code == 200, r.text
    r = post(app, "/v1/messages", {**msg, "max_tokens": 3.5})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    chat = {"model": "m", "messages": ASK, "max_tokens": 2.0, "n": 2.0, "seed": 7.0}
    r = post(app, CHAT, chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = post(app, "/v1/completions", {"model": "m", "prompt": [1.0, 2.0, 3.0], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    r = post(app, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2.0})
    assert r.status_code == 200


def test_top_k_0_and_empty_stop_strings_are_served_as_the_document_allows(app):
    for extra in ({"top_k": 0}, {"stop": ""}, {"stop": ["", "Paris"]}):
        r = post(app, "/v1/completions", {"model": "m", "prompt": "The capital", "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    msg = {"model": "m", "max_tokens": 2, "top_k": 0, "messages": [{"role": "user", "content": "hi"}]}
    assert post(app, "/v1/messages", msg).status_code == 200


# ---- request data reaches the log escaped -------------------------------------------------------
def test_a_request_field_name_with_a_newline_cannot_forge_a_log_line(app, caplog):
    forged = "x\nERROR trtedge.server: forged\r"
    body = {"model": "m", "messages": ASK, "max_tokens": 1, forged: 1, "tab\there\u2028": 2}
    with caplog.at_level(logging.INFO, logger="trtedge.server"):
        assert post(app, CHAT, body).status_code == 200
        many = {f"k{i}": i for i in range(500)}
        assert post(app, CHAT, {"model": "m", "messages": ASK, "max_tokens": 1, **many}).status_code == 200
    [first, second] = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert "x\\nERROR trtedge.server: forged\\r" in first and "tab\\there\\u2028" in first
    assert all(c.isprintable() for c in first + second)
    assert not any(line.startswith("ERROR trtedge.server: forged") for line in caplog.text.splitlines())
    assert len(second) < 400 and "(+480 more)" in second  # bounded, however many fields come


def test_the_engine_error_text_reaches_the_log_escaped(app, llm, monkeypatch, caplog):
    class Broken:
        """A request whose engine hands its channel an error with a forged log line in its text."""

        def __init__(self, channel):
            channel.put(ValueError("engine said\nINFO trtedge.server: all good"))
            channel.batcher.flush()

        def cancel(self):
            pass

    monkeypatch.setattr(llm, "generate_stream", lambda *args, channel, **kwargs: Broken(channel))
    with caplog.at_level(logging.INFO):
        reply = asyncio.run(call(app, CHAT, {"model": "m", "messages": ASK, "max_tokens": 1}))
    assert reply.status == 500 and json.loads(reply.body)["error"]["code"] == "engine_error"
    [record] = [r for r in caplog.records if "failed in the engine" in r.getMessage()]
    assert "engine said\\nINFO trtedge.server: all good" in record.getMessage()
    assert not any(line.startswith("INFO trtedge.server: all good") for line in caplog.text.splitlines())
