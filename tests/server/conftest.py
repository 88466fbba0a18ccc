from __future__ import annotations

import pytest


def load_llm(tmp_path_factory, **kwargs):
    """The embedded model with a small KV pool; its bundle goes to the session's scratch cache (shared with
    the servers and CLI runs of tests/conftest.py's environment)."""
    from trtedge import LLM
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return LLM(max_kv_cache_capacity=1024, max_input_len=512, **kwargs)
