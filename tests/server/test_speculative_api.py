"""The HTTP server with speculative decoding: a chat completion with ``disable_spec_decode: true``
generates the same tokens without a verification step, one without it verifies drafts; a bad value
is a 400 naming the field."""

from __future__ import annotations

import pytest

from tests.server.test_api import assert_error, request
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM
from trtedge.server.app import build_app

pytest.importorskip("transformers")


def test_disable_spec_decode_per_request_over_http(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    options = dict(dtype="float32", max_kv_cache_capacity=256, max_input_len=128, speculative_config=spec)
    with LLM(str(path), **options) as llm:
        app = build_app(llm)
        body = {"prompt": " ".join(f"w{i}" for i in [5, 6, 7, 8] * 6), "max_tokens": 12, "temperature": 0}
        outputs = []
        for extra in ({"disable_spec_decode": True}, {}):
            before = llm.stats()["speculative"]["steps"]
            response = request(app, "POST", "/v1/completions", json={**body, **extra})
            assert response.status_code == 200, response.text
            outputs.append(response.json()["choices"][0]["text"])
            steps = llm.stats()["speculative"]["steps"] - before
            assert (steps == 0) if extra else (steps > 0)
        assert outputs[0] == outputs[1]
        bad = request(app, "POST", "/v1/completions", json={**body, "disable_spec_decode": "sometimes"})
        assert_error(bad, 400, "disable_spec_decode")
