"""The HTTP server over a hybrid model with speculative decoding and context reuse:
``cache_generated_tokens: true`` is a 400 naming the field; unset, the request runs."""

from __future__ import annotations

import pytest

from tests.server.test_api import assert_error, request
from tests.tiny import make_tiny_hybrid_checkpoint
from trtedge import LLM, ContextCacheConfig
from trtedge.server.app import build_app

pytest.importorskip("transformers")


def test_cache_generated_tokens_true_is_a_400_with_speculative_hybrid(tmp_path):
    path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False)
    options = dict(dtype="float32", max_kv_cache_capacity=256, max_input_len=128)
    reuse = ContextCacheConfig(enabled=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(path), context_cache_config=reuse, speculative_config=spec, **options) as llm:
        app = build_app(llm)
        body = {"prompt": " ".join(f"w{i}" for i in [5, 6, 7, 8] * 6), "max_tokens": 8, "temperature": 0}
        refused = request(app, "POST", "/v1/completions", json={**body, "cache_generated_tokens": True})
        assert_error(refused, 400, "cache_generated_tokens", "speculative decoding on a hybrid model")
        for extra in (
            {},
            {"cache_generated_tokens": False},
            {"cache_generated_tokens": True, "disable_spec_decode": True},
        ):
            ok = request(app, "POST", "/v1/completions", json={**body, **extra})
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] == 8
        stats = llm.stats()
        assert stats["active_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["state_slots_free"] == stats["state_slots_total"]
