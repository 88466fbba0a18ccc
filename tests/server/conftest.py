from __future__ import annotations

import pytest


def load_llm(tmp_path_factory, **kwargs):
    """The embedded model with a small KV pool, cached bundles kept in the session's temp dir."""
    from trtedge import LLM
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    return LLM(cache_dir=str(cache), max_kv_cache_capacity=1024, max_input_len=512, **kwargs)
