"""A build killed with SIGKILL midway leaves no usable partial bundle, and the next launch builds it
(the cache's atomic publish; the helpers live with the other process tests in tests/runtime)."""

from __future__ import annotations

import os
import signal
import time

from tests.runtime.test_bundle import _key, _spawn, cache_dir, tiny  # noqa: F401, F811 (fixtures)
from trtedge.runtime.artifacts.bundle import prepare_bundle


def test_kill_9_during_build_leaves_nothing_used_and_next_launch_completes(tiny, cache_dir, monkeypatch):  # noqa: F811
    proc = _spawn(tiny, cache_dir, delay=60)
    bundles = cache_dir / "bundles"
    deadline = time.monotonic() + 60
    while not list(bundles.glob(".tmp-*/config.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    key = _key(tiny)
    assert not (bundles / key).exists() and list(bundles.glob(".tmp-*"))

    monkeypatch.delenv("TRTEDGE_TEST_BUILD_DELAY", raising=False)
    bundle = prepare_bundle(str(tiny), cache_dir=cache_dir)
    bundle.release()
    assert bundle.built and bundle.key == key
    assert sorted(p.name for p in bundles.iterdir()) == [key]  # the killed build's temp dir is gone
