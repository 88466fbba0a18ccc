from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Tests never touch the user's cache, config or history. The environment is pointed at a scratch home
# here, when pytest imports this conftest: before any test module is collected and before any
# session- or module-scoped fixture runs (an autouse fixture would come too late for those).
USER_DIRS = {
    "TRTEDGE_CACHE_DIR": "cache/trtedge",
    "XDG_CACHE_HOME": "cache",
    "XDG_CONFIG_HOME": "config",
    "XDG_DATA_HOME": "data",
    "XDG_STATE_HOME": "state",
    "TRTEDGE_CHAT_HISTORY": "data/trtedge/chat_history",
}
SCRATCH_HOME = Path(tempfile.mkdtemp(prefix="trtedge-tests-"))
for _name, _sub in USER_DIRS.items():
    os.environ[_name] = str(SCRATCH_HOME / _sub)
for _name in ("TRTEDGE_CONFIG", "TRTEDGE_API_KEY"):  # a user's settings must not change what tests launch
    os.environ.pop(_name, None)
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_unconfigure(config):
    shutil.rmtree(SCRATCH_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 model, loaded once for the whole session."""
    from trtedge import LLM
    from trtedge.runtime.artifacts.embedded import embedded_model_path

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
    from trtedge.runtime.artifacts.embedded import gemma3_model_path

    try:
        return gemma3_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
