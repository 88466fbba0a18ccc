"""Limits of `trtedge serve`: body size (413), per-request caps (400 naming the field), and slow
clients (slowloris) that must not keep real requests waiting."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time

import httpx
import pytest

from tests.reliability.common import CHAT, COMPLETIONS, assert_error
from trtedge.server.config import HEADER_TIMEOUT, MAX_BODY_BYTES
from trtedge.server.errors import APIError

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": HI, "max_tokens": 10**12}, "max_tokens"),
        (CHAT, {"messages": HI, "max_completion_tokens": 513}, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 512}, "max_tokens"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 1000}, "logprobs"),
        (CHAT, {"messages": HI, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        (CHAT, {"messages": HI, "n": 17}, "n"),
        (COMPLETIONS, {"prompt": "hi", "n": 10**6}, "n"),
        (COMPLETIONS, {"prompt": "word " * 300}, "prompt"),
        (CHAT, {"messages": HI, "cache_salt": "x" * 257}, "cache_salt"),
    ],
)
def test_per_request_caps_are_400_naming_the_field(served, path, body, param):
    error = assert_error(httpx.post(served.url + path, json=body, timeout=60), 400)
    assert error["param"] == param, error


def test_caps_at_the_limit_are_served(served):
    body = {
        "messages": HI,
        "max_tokens": 2,
        "n": 16,
        "logprobs": True,
        "top_logprobs": 20,
        "logit_bias": {str(i): 0.5 for i in range(1024)},
        "stop": [f"stop-{i}" for i in range(16)],
    }
    r = httpx.post(served.url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16


def test_a_body_over_the_cap_is_413(served):
    big = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    assert_error(httpx.post(served.url + COMPLETIONS, content=big, timeout=60), 413, "request_too_large")

    def chunks():  # no Content-Length: the cap holds while reading
        for _ in range(MAX_BODY_BYTES // 2**20 + 2):
            yield b"x" * 2**20

    r = httpx.post(served.url + COMPLETIONS, content=chunks(), timeout=60)
    assert_error(r, 413, "request_too_large")
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200


def test_a_body_that_never_finishes_is_408():
    from starlette.requests import Request

    from trtedge.server.app import read_body

    async def receive():
        await asyncio.sleep(3600)

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(request, 1000, timeout=0.2))
    assert e.value.status == 408 and e.value.code == "request_timeout"


def _slow_client(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    return sock


def test_slowloris_clients_neither_block_real_requests_nor_stay_connected(served):
    """100 connections trickle header bytes once a second; real requests are answered meanwhile and the
    server drops the slow connections once HEADER_TIMEOUT has passed."""
    slow = [_slow_client(served.url) for _ in range(100)]
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    started = time.monotonic()
    answered = []
    closed_by_server = set()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        real = [pool.submit(httpx.post, served.url + COMPLETIONS, json=body, timeout=30) for _ in range(8)]
        while time.monotonic() - started < HEADER_TIMEOUT + 5 and len(closed_by_server) < len(slow):
            for i, sock in enumerate(slow):
                if i in closed_by_server:
                    continue
                try:
                    sock.sendall(b"X")
                except OSError:
                    closed_by_server.add(i)
            time.sleep(1)
        answered = [f.result() for f in real]
    for sock in slow:
        sock.close()
    assert [r.status_code for r in answered] == [200] * 8
    assert len(closed_by_server) == len(slow)  # each was dropped after the header deadline
    assert httpx.get(served.url + "/health", timeout=10).json()["status"] == "ok"


def test_a_guide_over_128_kib_is_400_naming_it(served):
    body = {"messages": HI, "guided_regex": "a" * (128 * 1024 + 1)}
    error = assert_error(httpx.post(served.url + CHAT, json=body, timeout=60), 400)
    assert "guided" in error["param"] and "131072" in error["message"], error
