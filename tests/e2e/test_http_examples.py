"""The response examples in the HTTP reference are what a live server answers: same fields at every
level (values such as ids, times and paths differ)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.serve_process import ServeProcess

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from capture_http_examples import capture  # noqa: E402
from generate_http_reference import RESPONSES  # noqa: E402


def differences(documented, live, where: str = "") -> list[str]:
    if isinstance(documented, dict) and isinstance(live, dict):
        found = [f"{where}.{k}: documented, not answered" for k in documented.keys() - live.keys()]
        found += [f"{where}.{k}: answered, not documented" for k in live.keys() - documented.keys()]
        for key in documented.keys() & live.keys():
            found += differences(documented[key], live[key], f"{where}.{key}")
        return found
    if isinstance(documented, list) and isinstance(live, list) and documented and live:
        return differences(documented[0], live[0], f"{where}[0]")
    if isinstance(documented, dict | list) != isinstance(live, dict | list):
        return [f"{where}: documented {type(documented).__name__}, answered {type(live).__name__}"]
    return []


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServeProcess(tmp_path_factory, [])
    yield process
    process.stop()


def test_documented_responses_match_a_live_server(server):
    documented = json.loads(RESPONSES.read_text())
    live = capture(server.url)
    assert documented.keys() == live.keys()
    problems = [p for path in live for p in differences(documented[path], live[path], path)]
    assert not problems, (
        "the HTTP reference's response examples drifted; refresh them with "
        "scripts/capture_http_examples.py and scripts/generate_http_reference.py:\n" + "\n".join(problems)
    )
