"""Tests never touch the user's cache, config or history: the root conftest points every such path at a
scratch directory before collection, so even session- and module-scoped fixtures cannot reach them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trtedge.chat.tui import history_path
from trtedge.runtime.artifacts.checkpoint import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("isolation_probe.py")


def test_a_run_whose_fixtures_write_the_defaults_leaves_the_home_untouched(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "TRTEDGE_"))}
    env["HOME"] = str(home)  # a user with no overrides: every default derives from HOME
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PROBE)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert written == [], f"a test run wrote into the user's home: {written}"


def test_this_session_resolves_every_default_outside_the_home():
    home = Path.home().resolve()
    for path in (default_cache_dir(), history_path()):
        assert home not in path.resolve().parents, path
