"""Run by test_isolation.py as its own pytest session (the name keeps it out of the default run): a
session- and a module-scoped fixture, like the suite's model fixtures, write through trtedge's default
cache and history paths before any autouse fixture could redirect them."""

from __future__ import annotations

import pytest

from trtedge.chat.tui import history_path
from trtedge.runtime.artifacts.checkpoint import default_cache_dir


def _write_defaults(tag: str) -> None:
    cache = default_cache_dir() / "bundles" / tag
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "manifest.json").write_text("{}")
    history = history_path()
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text(tag)


@pytest.fixture(scope="session")
def session_model():
    _write_defaults("session")


@pytest.fixture(scope="module")
def module_model():
    _write_defaults("module")


def test_fixtures_wrote_their_defaults(session_model, module_model):
    pass  # test_isolation.py looks at where the files went
