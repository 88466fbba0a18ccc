from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Tests never write into the user's cache; kernels compile once per session.
    monkeypatch.setenv("TRTEDGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "trtedge-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 model, loaded once for the whole session."""
    from trtedge import LLM
    from trtedge.runtime.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(max_kv_cache_capacity=2048, max_input_len=1024)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Path of the packaged Gemma 3 270M GGUF (the second embedded model), or skip."""
    from trtedge.runtime.embedded import gemma3_model_path

    try:
        return gemma3_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
