"""The chat backends without a model: the local one over a scripted engine stream, the HTTP one over
httpx's mock transport speaking the OpenAI streaming format."""

from __future__ import annotations

import json
import queue
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from trtedge.chat.backends import BackendError, HttpBackend, LocalBackend
from trtedge.runtime.output import CancellableIterator, GenerationMetrics, StreamDelta
from trtedge.runtime.sampling_params import SamplingParams


class ScriptedLLM:
    """Stands in for LLM: streams the given pieces from a thread, like the engine, and reports metrics
    just after the final delta (as the engine does)."""

    def __init__(self, pieces, delay=0.0, capacity=64, max_input_len=48):
        self.pieces = pieces
        self.delay = delay
        self.model_name = "scripted"
        self.config = SimpleNamespace(max_kv_cache_capacity=capacity, max_input_len=max_input_len)
        self.params = None

    def encode_prompt(self, prompt, apply_chat_template=None):
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return list(range(len(text.split())))

    def check_lengths(self, num_prompt_tokens, max_tokens):
        raise ValueError(f"prompt has {num_prompt_tokens} tokens, too many")

    def generate_stream(self, ids, params, on_metrics=None):
        self.params = params
        channel: queue.Queue = queue.Queue()
        stop = threading.Event()

        def run():
            n = 0
            reason = "stop"
            for piece in self.pieces:
                if stop.is_set():
                    reason = "cancelled"
                    break
                time.sleep(self.delay)
                n += 1
                channel.put(StreamDelta(piece, [n], None, None, len(ids), n))
            channel.put(StreamDelta("", [], reason, None, len(ids), n))
            time.sleep(0.05)
            on_metrics(GenerationMetrics(len(ids), n, n - 1, 0.01, 0.01, 0.1, 42.0, 0, reason))

        threading.Thread(target=run, daemon=True).start()
        return CancellableIterator(channel, stop.set)

    def close(self):
        pass


def test_local_stream_yields_text_then_metrics():
    llm = ScriptedLLM(["Hello", ", ", "world"])
    stream = LocalBackend(llm).stream(
        [{"role": "user", "content": "say hello"}], SamplingParams(max_tokens=8)
    )
    assert "".join(c.text for c in stream) == "Hello, world"
    m = stream.metrics
    assert (m.prompt_tokens, m.generated_tokens, m.decode_tokens_per_second) == (2, 3, 42.0)
    assert m.finish_reason == "stop" and m.latency > 0


def test_local_max_tokens_is_trimmed_to_the_room_left_in_the_context():
    llm = ScriptedLLM(["x"], capacity=10)
    LocalBackend(llm).stream("one two three", SamplingParams(max_tokens=100))
    assert llm.params.max_tokens == 7
    with pytest.raises(ValueError, match="too many"):
        LocalBackend(llm).stream(" ".join(["w"] * 10), SamplingParams(max_tokens=1))


def test_local_cancel_ends_the_stream_with_metrics():
    llm = ScriptedLLM(["tok "] * 200, delay=0.01)
    stream = LocalBackend(llm).stream("go", SamplingParams(max_tokens=200))
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            stream.cancel()
    assert 3 <= len(chunks) < 200
    assert stream.cancelled and stream.metrics.finish_reason == "cancelled"


def _sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _chunk(content=None, finish=None, reasoning=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _server(chat_handler):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served-model"}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "capabilities": {"max_model_len": 1024}})
        if request.url.path == "/v1/chat/completions":
            seen["body"] = json.loads(request.content)
            seen["auth"] = request.headers.get("authorization")
            return chat_handler(request)
        return httpx.Response(404, json={"error": {"message": "not found"}})

    return httpx.MockTransport(handler), seen


def test_http_stream_sends_openai_request_and_reads_usage():
    body = _sse(
        _chunk(""),
        _chunk(reasoning="hmm"),
        _chunk("Paris"),
        _chunk(" it is.", finish="stop"),
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}},
    )
    transport, seen = _server(lambda r: httpx.Response(200, content=body))
    backend = HttpBackend("http://srv/v1/", api_key="k", transport=transport)
    assert backend.model_name == "served-model" and backend.max_context == 1024
    params = SamplingParams(max_tokens=16, temperature=0.0, seed=3, top_k=5)
    stream = backend.stream([{"role": "user", "content": "capital?"}], params)
    chunks = list(stream)
    assert [(c.text, c.reasoning) for c in chunks] == [("hmm", True), ("Paris", False), (" it is.", False)]
    sent = seen["body"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["model"], sent["max_tokens"], sent["temperature"], sent["seed"], sent["top_k"]) == (
        "served-model",
        16,
        0.0,
        3,
        5,
    )
    assert "min_p" not in sent  # extensions only when set
    assert seen["auth"] == "Bearer k"
    m = stream.metrics
    assert (m.prompt_tokens, m.generated_tokens, m.finish_reason) == (12, 5, "stop")
    assert ("server", "http://srv") in backend.describe()


def test_http_errors_carry_the_server_message():
    transport, _ = _server(
        lambda r: httpx.Response(400, json={"error": {"message": "prompt is too long", "param": "messages"}})
    )
    backend = HttpBackend("http://srv", model="m", transport=transport)
    with pytest.raises(BackendError, match="HTTP 400: prompt is too long"):
        backend.stream([{"role": "user", "content": "x"}], SamplingParams())
    body = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\nevent: error\ndata: {"error": {"message": "engine died"}}\n\n'
    transport, _ = _server(lambda r: httpx.Response(200, content=body))
    stream = HttpBackend("http://srv", model="m", transport=transport).stream([], SamplingParams())
    with pytest.raises(BackendError, match="engine died"):
        list(stream)


def test_http_unreachable_server_and_raw_prompts_are_refused():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(BackendError, match="cannot reach http://nowhere"):
        HttpBackend("http://nowhere", transport=httpx.MockTransport(refuse))
    transport, _ = _server(lambda r: httpx.Response(200, content=_sse()))
    with pytest.raises(BackendError, match="--no-chat-template"):
        HttpBackend("http://srv", transport=transport).stream("raw text", SamplingParams())


def test_http_cancel_ends_the_iteration_at_once():
    def slow_body():
        for i in range(1000):
            time.sleep(0.01)
            yield b"data: " + json.dumps(_chunk(f"t{i} ")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    transport, _ = _server(lambda r: httpx.Response(200, content=slow_body()))
    stream = HttpBackend("http://srv", model="m", transport=transport).stream([], SamplingParams())
    start = time.monotonic()
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            stream.cancel()
    assert stream.cancelled and got < 20 and time.monotonic() - start < 5
    m = stream.wait_metrics(5.0)
    assert m is not None and m.finish_reason == "cancelled"
