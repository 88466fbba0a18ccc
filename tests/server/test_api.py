"""The HTTP API in-process on the embedded model (one request at a time): protocol, errors, auth,
queueing, hang-ups, metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.asgi import call, wait_for
from tests.server.conftest import load_llm
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = load_llm(tmp_path_factory)
    yield llm
    llm.close()


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())


def assert_error(response: httpx.Response, status: int, param: str | None = None, text: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert text in error["message"], error
    return error


def test_chat_answers_with_engine_usage(llm):
    app = build_app(llm)
    r = request(app, "POST", CHAT, json={"messages": PARIS, "max_tokens": 16, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert "Paris" in body["choices"][0]["message"]["content"]
    expected = llm.chat(PARIS, __import__("trtedge").SamplingParams(max_tokens=16, temperature=0))
    assert body["usage"]["prompt_tokens"] == expected.prompt_tokens
    assert body["usage"]["completion_tokens"] == expected.completion_tokens
    assert body["choices"][0]["message"]["content"] == expected.text


def test_content_parts_developer_role_and_raw_prompt(llm):
    app = build_app(llm)
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    r = request(app, "POST", CHAT, json={"messages": parts, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    templated = r.json()["usage"]["prompt_tokens"]
    raw = request(app, "POST", CHAT, json={"messages": PARIS, "max_tokens": 2, "apply_chat_template": False})
    assert raw.status_code == 200 and raw.json()["usage"]["prompt_tokens"] < templated
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_error(
        request(app, "POST", CHAT, json={"messages": image}),
        400,
        "messages.0.content.0.image_url",
        "this model has no vision component",
    )
    audio = [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
    ]
    assert_error(
        request(app, "POST", CHAT, json={"messages": audio}),
        400,
        "messages.0.content.0.input_audio",
        "this model has no audio component",
    )


def test_n_choices_with_a_seed_differ_and_repeat(llm):
    app = build_app(llm)
    body = {"messages": PARIS, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2}
    a = request(app, "POST", CHAT, json=body).json()
    b = request(app, "POST", CHAT, json=body).json()
    texts = [c["message"]["content"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert texts == [c["message"]["content"] for c in b["choices"]]
    assert texts[0] != texts[1]
    assert a["usage"]["completion_tokens"] > 8  # both choices counted


def test_default_max_tokens_is_the_remaining_context(llm, monkeypatch):
    app = build_app(llm)
    seen = []
    real = llm.generate_stream

    def spy(prompt, params, **kwargs):
        seen.append((len(prompt), params.max_tokens))
        return real(prompt, params.__class__(**{**params.__dict__, "max_tokens": 1}), **kwargs)

    monkeypatch.setattr(llm, "generate_stream", spy)
    r = request(app, "POST", "/v1/completions", json={"prompt": list(range(1000, 1500))})
    assert r.status_code == 200 and seen == [(500, 1024 - 500)]
    r = request(app, "POST", CHAT, json={"messages": PARIS})
    assert r.status_code == 200 and seen[1][1] == 1024 - seen[1][0]


def test_prompt_plus_max_tokens_over_the_context_names_both_numbers(llm):
    body = {"prompt": list(range(1000, 1500)), "max_tokens": 525}
    r = request(build_app(llm), "POST", "/v1/completions", json=body)
    error = assert_error(r, 400, "max_tokens", "prompt (500 tokens) + max_tokens (525)")
    assert "1024" in error["message"] and error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "body,status,param,text",
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        ({"messages": PARIS, "temperature": "hot"}, 400, "temperature", "number"),
        ({"messages": PARIS, "max_tokens": 0}, 400, "max_tokens", ""),
        ({"messages": PARIS, "seed": -1}, 400, "seed", ""),
        ({"messages": PARIS, "seed": 2**64}, 400, "seed", ""),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ""),
        ({"messages": []}, 400, "messages", ""),
        ({}, 400, "messages", "required"),
        ({"messages": PARIS, "stop": ["ok", 3]}, 400, "stop.1", ""),
        ({"messages": PARIS, "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
        ({"messages": PARIS, "top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
        ({"messages": PARIS, "model": "gpt-4o"}, 404, "model", "does not exist"),
        (
            {"messages": PARIS, "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            "tool_choice",
            "--enable-auto-tool-choice",
        ),
        ({"messages": PARIS, "tools": [{"type": "code"}], "tool_choice": "none"}, 400, "tools.0.type", ""),
        (
            {"messages": PARIS, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
            400,
            "guided_regex",
            "set only one of response_format and guided_regex",
        ),
        ({"messages": PARIS, "guided_decoding": {"regex": "[a-"}}, 400, "guided_decoding", "Unclosed '['"),
        ({"messages": PARIS, "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
        (
            {
                "messages": PARIS,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            400,
            "tool_choice",
            "drop the structured-output field",
        ),
        ({"messages": [{"role": "user", "content": "x" * 4000}]}, 400, "messages", "max_input_len 512"),
    ],
)
def test_chat_errors_name_the_field(llm, body, status, param, text):
    app = build_app(llm)
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    assert_error(request(app, "POST", CHAT, **kwargs), status, param, text)


@pytest.mark.parametrize(
    "body,param,text",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": [1, 2, "a"]}, "prompt.2", "integer"),
        ({"prompt": [10**7]}, "prompt", "vocabulary"),
        ({"prompt": list(range(5, 600)), "max_tokens": 4}, "prompt", "595 tokens"),
    ],
)
def test_completion_errors_name_the_field(llm, body, param, text):
    assert_error(request(build_app(llm), "POST", "/v1/completions", json=body), 400, param, text)


def test_body_over_the_cap_is_413(llm):
    app = build_app(llm, ServeConfig(max_body_bytes=1000))
    r = request(app, "POST", CHAT, json={"messages": [{"role": "user", "content": "x" * 2000}]})
    assert_error(r, 413, None, "larger than 1000 bytes")


def test_a_client_gone_before_its_body_arrived_is_499_not_an_internal_error(llm, caplog):
    app = build_app(llm)
    messages = [
        {"type": "http.request", "body": b'{"messages": [', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }
    with caplog.at_level("ERROR"):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_internal_error_is_500_without_internals(llm, monkeypatch):
    app = build_app(llm)

    def boom(*args, **kwargs):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(app.state.serving, "params", boom)
    r = request(app, "POST", CHAT, json={"messages": PARIS})
    error = assert_error(r, 500)
    assert "secret" not in r.text and "Traceback" not in r.text and error["type"] == "internal_error"


def test_engine_error_mid_stream_is_an_error_event_then_done(llm, monkeypatch):
    from trtedge.runtime.output import StreamDelta

    app = build_app(llm)

    class Failing:
        """A request whose engine hands its channel one delta, then an error (as Engine._fail does)."""

        cancelled = False

        def __init__(self, channel):
            channel.put(StreamDelta("Hel", [1]))
            channel.put(RuntimeError("device lost"))
            channel.batcher.flush()

        def cancel(self):
            self.cancelled = True

    monkeypatch.setattr(llm, "generate_stream", lambda *a, channel, **k: Failing(channel))
    reply = asyncio.run(call(app, CHAT, {"messages": PARIS, "stream": True}))
    events = reply.events()
    assert reply.status == 200
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hel"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_error" and "device lost" not in reply.body.decode()
    assert "event: error" in reply.body.decode() and events[-1] == "[DONE]"
    assert app.state.admission.num_active == 0


def test_api_key_guards_v1_only(llm):
    app = build_app(llm, ServeConfig(api_key="sekret"))
    assert_error(request(app, "GET", "/v1/models"), 401, None, "API key")
    assert_error(request(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(request(app, "POST", CHAT, json={"messages": PARIS}), 401)
    assert request(app, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert request(app, "GET", "/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
    assert request(app, "GET", "/health").status_code == 200
    assert request(app, "GET", "/health/ready").status_code == 200


def test_models_and_served_name(llm):
    app = build_app(llm, ServeConfig(served_model_name="smol"))
    data = request(app, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["smol"] and data[0]["max_model_len"] == 1024
    assert request(app, "GET", "/v1/models/smol").json()["id"] == "smol"
    assert_error(request(app, "GET", "/v1/models/other"), 404, "model")
    r = request(app, "POST", CHAT, json={"messages": PARIS, "model": "smol", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "smol"


def slow(max_tokens: int = 400) -> dict:
    return {"messages": PARIS, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def test_queue_of_one_third_request_gets_429_and_hang_ups_free_everything(llm):
    app = build_app(llm, ServeConfig(max_queued_requests=1))
    admission = app.state.admission
    before = llm.stats()

    async def main():
        hang_up = [asyncio.Event(), asyncio.Event()]
        first = asyncio.ensure_future(call(app, CHAT, slow(), hang_up=hang_up[0]))
        await wait_for(lambda: llm.stats()["running"] == 1)
        second = asyncio.ensure_future(call(app, CHAT, slow(), hang_up=hang_up[1]))
        await wait_for(lambda: admission.num_waiting == 1)
        third = await call(app, CHAT, slow())
        assert third.status == 429 and int(third.headers["retry-after"]) >= 1
        assert json.loads(third.body)["error"]["code"] == "rate_limit_exceeded"
        health = json.loads((await call(app, "/health", method="GET")).body)
        assert (health["active_requests"], health["queued_requests"]) == (1, 1)
        hang_up[1].set()  # the queued client leaves the queue
        await second
        hang_up[0].set()  # the running client hangs up: its generation is cancelled in the engine
        reply = await first
        assert reply.status == 200 and b"[DONE]" not in reply.body
        await wait_for(lambda: llm.stats()["active_requests"] == 0, timeout=5)

    asyncio.run(main())
    after = llm.stats()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["submitted"] == before["submitted"] + 1  # the queued one never reached the engine
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert (admission.num_active, admission.num_waiting) == (0, 0)
    assert admission.stats.left_queue == 1 and admission.stats.refused_queue_full == 1


def test_waiting_past_queue_timeout_is_429(llm):
    app = build_app(llm, ServeConfig(max_queued_requests=2, queue_timeout=0.3))

    async def main():
        hang_up = asyncio.Event()
        first = asyncio.ensure_future(call(app, CHAT, slow(), hang_up=hang_up))
        await wait_for(lambda: llm.stats()["running"] == 1)
        late = await call(app, CHAT, {"messages": PARIS, "max_tokens": 2})
        hang_up.set()
        await first
        return late

    late = asyncio.run(main())
    assert late.status == 429 and "--queue-timeout" in late.json()["error"]["message"]
    assert "retry-after" in late.headers


def test_non_streaming_hang_up_cancels_in_the_engine(llm):
    app = build_app(llm)
    before = llm.stats()["cancelled"]

    async def main():
        hang_up = asyncio.Event()
        task = asyncio.ensure_future(
            call(app, CHAT, {"messages": PARIS, "max_tokens": 500, "ignore_eos": True}, hang_up=hang_up)
        )
        await wait_for(lambda: llm.stats()["running"] == 1)
        hang_up.set()
        return await task

    reply = asyncio.run(main())
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["finish_reason"] == "cancelled" and usage["completion_tokens"] < 500
    assert llm.stats()["cancelled"] == before + 1
    assert app.state.admission.num_active == 0


def test_metrics_count_requests_tokens_and_latency(llm):
    app = build_app(llm)
    request(app, "POST", CHAT, json={"messages": PARIS, "max_tokens": 4})
    request(app, "POST", CHAT, json={"messages": []})
    text = request(app, "GET", "/metrics").text
    assert 'trtedge_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'trtedge_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert "trtedge_time_to_first_token_seconds_count 1.0" in text
    assert "trtedge_request_queue_seconds_count 1.0" in text
    assert "trtedge_generation_tokens_total 4.0" in text
    assert f"trtedge_engine_steps {float(llm.stats()['steps'])}" in text and llm.stats()["steps"] > 0
    assert f"trtedge_engine_preemptions {float(llm.stats()['preemptions'])}" in text
    for name in (
        "inter_token_latency_seconds",
        "prompt_tokens_total",
        "requests_running",
        "requests_waiting",
        "kv_cache_blocks_in_use",
    ):
        assert f"trtedge_{name}" in text


def test_health_reports_capabilities_and_engine(llm):
    body = request(build_app(llm), "GET", "/health").json()
    assert body["status"] == "ok" and body["model"] == llm.model_name
    assert body["capabilities"] == {
        "max_model_len": 1024,
        "max_input_len": 512,
        "max_batch_size": 1,
        "in_flight_batching": False,
        "context_reuse": False,
        "speculative": None,
        "structured_output": True,
        "vision": False,
        "audio": False,
        "speech_output": False,
    }
    assert "scheduling" not in body
    assert body["engine"]["kv_blocks_free"] == body["engine"]["kv_blocks_total"] == 64


def test_failed_engine_makes_health_503_with_the_reason(llm, monkeypatch):
    app = build_app(llm)
    stats = llm.stats
    monkeypatch.setattr(llm, "stats", lambda: {**stats(), "engine_error": "CUDA error: device lost"})
    r = request(app, "GET", "/health")
    assert r.status_code == 503 and "device lost" in r.json()["reason"]
    assert request(app, "GET", "/health/ready").status_code == 503


def test_completion_prompt_list_with_n_gives_consecutive_choices(llm):
    app = build_app(llm)
    a, b = [504, 3575, 282, 4649, 314], [1, 504, 3575]
    body = {"prompt": [a, b], "n": 2, "max_tokens": 3, "temperature": 0}
    r = request(app, "POST", "/v1/completions", json=body).json()
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    alone = request(app, "POST", "/v1/completions", json={"prompt": b, "max_tokens": 3, "temperature": 0})
    assert texts[0] == texts[1] and texts[2] == texts[3] == alone.json()["choices"][0]["text"]
    assert r["usage"]["prompt_tokens"] == len(a) + len(b)  # each prompt counted once
    assert r["usage"]["completion_tokens"] == 12

    async def stream():
        return await call(app, "/v1/completions", {**body, "stream": True})

    events = [json.loads(e) for e in asyncio.run(stream()).events()[:-1]]
    streamed = ["", "", "", ""]
    for e in events:
        streamed[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert streamed == texts


def test_openapi_document_describes_what_the_server_validates(llm):
    jsonschema = pytest.importorskip("jsonschema")
    app = build_app(llm, ServeConfig(api_key="k"))
    response = request(app, "GET", "/openapi.json")  # open, like /health
    assert response.status_code == 200
    doc = response.json()
    assert doc["openapi"].startswith("3.1")
    assert {"/health", "/v1/models", CHAT, "/v1/completions"} <= set(doc["paths"])
    components = doc["components"]["schemas"]

    def validator(name):
        return jsonschema.Draft202012Validator(
            {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        )

    chat = validator("ChatCompletionRequest")
    assert chat.is_valid({"model": "m", "messages": PARIS, "max_tokens": 4})
    assert not chat.is_valid({"model": "m", "messages": PARIS, "max_tokens": "four"})
    assert not chat.is_valid({"model": "m"})  # messages required
    assert validator("CompletionRequest").is_valid({"model": "m", "prompt": [1, 2, 3]})
    messages = validator("MessagesRequest")
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(doc["paths"])
    assert messages.is_valid({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert not messages.is_valid(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )  # max_tokens
    assert validator("ResponsesRequest").is_valid({"model": "m", "input": "hi", "max_output_tokens": 4})
    assert not validator("ResponsesRequest").is_valid({"model": "m", "input": "hi", "max_output_tokens": 0})
    assert validator("CountTokensRequest").is_valid(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    # the server refuses what the document refuses, naming the same field
    bad = request(
        app,
        "POST",
        CHAT,
        json={"model": "m", "messages": PARIS, "max_tokens": "four"},
        headers={"Authorization": "Bearer k"},
    )
    assert_error(bad, 400, param="max_tokens")
    assert "Error" in components


def test_a_bias_past_the_vocabulary_is_a_400_naming_logit_bias(llm):
    app = build_app(llm)  # the engine's check (the vocabulary is the model's), named as data
    body = {"messages": PARIS, "max_tokens": 1, "logit_bias": {str(llm.vocab_size + 5): 1}}
    r = request(app, "POST", CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_a_runtime_error_at_submit_is_a_500_not_a_503(llm, monkeypatch):
    app = build_app(llm)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not an engine that is down")

    monkeypatch.setattr(llm, "generate_stream", broken)
    r = request(app, "POST", CHAT, json={"messages": PARIS, "max_tokens": 1})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "a bug" not in r.text
    assert app.state.admission.num_active == 0  # the seat was given back
