"""The request pipeline every API shares: a runtime error names its field as data, never read from its
wording (test_api.py has the HTTP cases)."""

from __future__ import annotations

import pytest

from trtedge.runtime.sampling_params import ParamError, SamplingParams
from trtedge.server.core import value_error


def test_sampling_checks_name_their_field_as_data():
    for kwargs, param in [
        ({"top_p": 2.0}, "top_p"),
        ({"logit_bias": {5: 500}}, "logit_bias"),
        ({"stop": ("",)}, "stop"),
        ({"guided_decoding": {"regex": ""}}, "guided_decoding.regex"),
    ]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param, (kwargs, e.value)


def test_the_field_comes_from_the_error_not_its_wording():
    assert value_error(ParamError("top_p", "bad"), "messages").param == "top_p"
    # a plain ValueError that happens to start with a field's name names the default field
    assert value_error(ValueError("temperature went wrong"), "messages").param == "messages"
    # a field the HTTP request does not have (the runtime's own name) is not shown as one
    assert value_error(ParamError("guided_decoding.regex", "bad"), "prompt").param == "prompt"


def test_a_param_error_crosses_the_engine_core_process_with_its_field():
    from trtedge.runtime.client import _error, _kind

    error = _error(_kind(ParamError("cache_generated_tokens", "no")), "no")
    assert isinstance(error, ParamError) and error.param == "cache_generated_tokens" and str(error) == "no"
    assert type(_error(_kind(ValueError("plain")), "plain")) is ValueError


def _sent_bodies(response) -> list[bytes]:
    import asyncio

    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    asyncio.run(response({"type": "http"}, receive, send))
    return sent


def test_a_stream_that_is_behind_sends_its_waiting_events_in_one_write():
    from trtedge.server import sse

    waiting = [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", b"data: 4\n\n"]
    closed = []

    async def events():
        while waiting:
            yield waiting.pop(0)

    # the first three are ready at once (the engine ran ahead); the fourth had to be waited for
    ready = iter([True, True, False, False])
    bodies = _sent_bodies(
        sse.SSEResponse(events(), on_close=lambda: closed.append(1), ready=lambda: next(ready))
    )
    assert bodies == [b"data: 1\n\ndata: 2\n\ndata: 3\n\n", b"data: 4\n\n", b""] and closed == [1]
    # without a readiness probe every event is its own write, as before
    waiting[:] = [b"data: 1\n\n", b"data: 2\n\n"]
    assert _sent_bodies(sse.SSEResponse(events(), on_close=lambda: None)) == [
        b"data: 1\n\n",
        b"data: 2\n\n",
        b"",
    ]
