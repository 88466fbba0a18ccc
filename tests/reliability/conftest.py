from __future__ import annotations

import pytest

from tests.serve_process import ServeProcess

# One plain server (no key) shared by the limits, fuzz and soak tests: in-flight batching (batch 8),
# room for 64 more in flight, context reuse on, small contexts so that runs stay short.
SERVE_ARGS = [
    "--max-kv-cache-capacity", "512", "--max-input-len", "256", "--enable-in-flight-batching",
    "--max-batch-size", "8", "--max-queued-requests", "64", "--enable-context-reuse", "--log-level", "warning",
]  # fmt: skip


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    server = ServeProcess(tmp_path_factory, SERVE_ARGS)
    yield server
    server.stop()
