"""`trtedge serve` as a real process on a free port, driven by the official openai SDK.

The server runs the embedded SmolLM2 with in-flight batching (batch 2, queue 2) and an API key.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time

import httpx
import pytest

from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")

KEY = "e2e-key"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
SOAK_REQUESTS = int(os.environ.get("TRTEDGE_SOAK_REQUESTS", "16"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [
        "--max-kv-cache-capacity", "1024", "--max-input-len", "512", "--enable-in-flight-batching",
        "--max-batch-size", "2", "--max-queued-requests", "2", "--api-key", KEY, "--log-level", "warning",
    ]  # fmt: skip
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_startup_prints_model_pool_and_url(server):
    out = server.out.read_text()
    assert "SmolLM2-135M-Instruct" in out
    assert "kv pool 128 blocks x 16 tokens = 2048 tokens" in out  # batch 2 x 1024
    assert f"http://127.0.0.1:{server.port}/v1" in out


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"


def test_chat(client, model):
    r = client.chat.completions.create(model=model, messages=PARIS, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage_matches_non_streaming(client, model):
    whole = client.chat.completions.create(model=model, messages=PARIS, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=PARIS,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_string_and_token_ids(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens == 8
    ids = [504, 3575, 282, 4649, 314]  # token ids go in as given: no template, no BOS
    r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in stream)
    plain = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert streamed == plain.choices[0].text and r.choices[0].text.endswith(plain.choices[0].text)
    assert len(r.choices[0].text) > len(plain.choices[0].text)  # echo puts the prompt first


def test_logprobs(client, model):
    r = client.chat.completions.create(
        model=model, messages=PARIS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the chosen one is the top
        assert bytes(t.bytes).decode() == t.token
    c = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0


def test_seed_reproducibility(client, model):
    def sample(seed):
        return (
            client.chat.completions.create(
                model=model, messages=PARIS, max_tokens=12, temperature=1.0, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1
    assert sample(2**64 - 1)  # a u64 seed is accepted


def test_stop_strings(client, model):
    greedy = client.chat.completions.create(model=model, messages=PARIS, max_tokens=16, temperature=0)
    text = greedy.choices[0].message.content
    assert " is " in text
    r = client.chat.completions.create(
        model=model, messages=PARIS, max_tokens=16, temperature=0, stop=[" is "]
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[: text.index(" is ")]


def test_errors_reach_the_sdk_as_openai_errors(client, model):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=PARIS)
    with pytest.raises(openai.BadRequestError, match="max_input_len 512"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi " * 900}])
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(
            model=model,
            messages=PARIS,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )


def test_a_text_only_model_refuses_images(client, model):
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    with pytest.raises(openai.BadRequestError, match="this model has no vision component") as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}]
        )
    assert e.value.body["param"] == "messages.0.content.1.image_url"


def test_api_key_required_on_v1_but_not_health(server, model):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": PARIS})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def _open_slow_stream(http: httpx.Client, server, model):
    body = {"model": model, "messages": PARIS, "max_tokens": 400, "ignore_eos": True, "stream": True}
    request = http.build_request(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": KEY}
    )
    response = http.send(request, stream=True)
    assert response.status_code == 200
    return response


def test_in_flight_limit_is_batch_plus_queue_then_429(server, client, model):
    with httpx.Client(timeout=60) as http:
        streams = [_open_slow_stream(http, server, model) for _ in range(4)]  # batch 2 + queue 2
        try:
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model=model, messages=PARIS, max_tokens=2)
            assert int(e.value.response.headers["retry-after"]) >= 1
            health = server.health()
            assert health["active_requests"] + health["queued_requests"] == 4
            assert health["scheduling"]["refused"] >= 1
        finally:
            for s in streams:
                s.close()  # hang up: generation is cancelled inside the engine
    _wait_idle(server)
    assert client.chat.completions.create(model=model, messages=PARIS, max_tokens=2).choices


def _wait_idle(server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        engine = health["engine"]
        idle = health["active_requests"] == 0 and health["queued_requests"] == 0
        if idle and engine["running"] == 0 and engine["kv_blocks_free"] == engine["kv_blocks_total"]:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {health}")
        time.sleep(0.1)


@pytest.mark.parametrize("num_requests", [SOAK_REQUESTS, pytest.param(200, marks=pytest.mark.slow, id="200")])
def test_streaming_soak_with_hang_ups_leaves_nothing_behind(server, client, model, num_requests):
    before = server.health()["scheduling"]
    rng = random.Random(0)
    hang_ups = set(rng.sample(range(num_requests), k=int(0.3 * num_requests)))

    def one(i: int) -> str:
        body = {"model": model, "messages": PARIS, "max_tokens": 24, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        for _ in range(200):  # concurrency equals the in-flight limit; a 429 means a seat is not free yet
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers,
                              timeout=120) as r:  # fmt: skip
                if r.status_code == 429:
                    time.sleep(0.05)
                    continue
                assert r.status_code == 200
                lines = r.iter_lines()
                if i in hang_ups:
                    for _, _ in zip(range(3), lines):
                        pass
                    return "hung up"  # leaving the block closes the connection mid-stream
                data = [line for line in lines if line.startswith("data: ")]
                assert data[-1] == "data: [DONE]" and '"finish_reason":"length"' in data[-2]
                return "done"
        raise AssertionError("never admitted")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(num_requests)))
    assert results.count("done") == num_requests - len(hang_ups)
    health = _wait_idle(server)
    after = health["scheduling"]
    assert after["completed"] - before["completed"] >= num_requests - len(hang_ups)
    assert 1 <= after["cancelled"] - before["cancelled"] <= len(hang_ups)
    print(
        f"\nsoak: {num_requests} streams, {len(hang_ups)} hung up, "
        f"{after['cancelled'] - before['cancelled']} cancelled in the engine, "
        f"{after['completed'] - before['completed']} completed; after: active {health['active_requests']}, "
        f"queued {health['queued_requests']}, kv free {health['engine']['kv_blocks_free']}/"
        f"{health['engine']['kv_blocks_total']}"
    )
    r = client.chat.completions.create(model=model, messages=PARIS, max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].message.content


def test_sigterm_drains_the_request_in_flight_then_exits(server, model):
    # Runs last: stops the module's server.
    body = {"model": model, "messages": PARIS, "max_tokens": 48, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": KEY},
                      timeout=120) as r:  # fmt: skip
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"role":"assistant"' in first
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    assert server.proc.wait(timeout=60) == 0
    out = server.out.read_text()
    assert "draining 1 active" in out and "engine released" in out
