"""The first request each coding-agent CLI sends today, replayed through the server: Claude Code's
(tests/fixtures/agents/claude-code-*.json: system turns inside messages, adaptive thinking,
output_config, context_management, 12 tools, max_tokens 32000) and Codex's (codex-*.json: developer
messages, a namespace tool group, a hosted web_search). Both are answered with a well-formed stream,
through a template that shows tools and through one that shows none (tools in the system prompt).

The bodies were captured with tests/e2e/agent_proxy.py from the CLI versions that
scripts/install-agents.sh pins, paths and ids anonymised; refresh them when the pins move."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.server.scripted import make_scripted_checkpoint
from tests.server.test_agent_requests import NO_TOOLS_TEMPLATE
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
CAPACITY = 32768


def fixture(prefix: str) -> dict:
    [path] = sorted(FIXTURES.glob(f"{prefix}-*.json"))
    return json.loads(path.read_text())


@pytest.fixture(scope="module", params=["template-shows-tools", "template-shows-no-tools"])
def app(request, tmp_path_factory):
    from trtedge import LLM

    directory = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model")
    if request.param == "template-shows-no-tools":
        config = directory / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": NO_TOOLS_TEMPLATE}))
    llm = LLM(
        str(directory),
        cache_dir=str(tmp_path_factory.getbasetemp() / "trtedge-cache"),
        max_kv_cache_capacity=CAPACITY,
        max_input_len=CAPACITY - 4096,
    )
    yield build_app(llm, ServeConfig(enable_auto_tool_choice=True, served_model_name="local"))
    llm.close()


def replay(app, record: dict, body: dict | None = None) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            headers = {**record["headers"], "authorization": "Bearer my-local-key"}
            return await client.post(record["path"], json=body or record["body"], headers=headers)

    return asyncio.run(main())


def sse(response: httpx.Response) -> list[tuple[str | None, dict]]:
    events, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            name = None
    return events


def test_claude_codes_first_request_is_retried_as_claude_code_does_and_streams(app):
    record = fixture("claude-code")
    assert [m["role"] for m in record["body"]["messages"]] == ["user", "system"]
    first = replay(app, record)
    assert first.status_code == 400, first.text
    message = first.json()["error"]["message"]
    # Claude Code's own rule: max_tokens = limit - input - 1000, when at least 3000 are left
    prefix = "input length and `max_tokens` exceed context limit: "
    assert message.startswith(prefix), message
    n, m, limit = (int(x) for x in message[len(prefix) :].split(",")[0].replace("+", ">").split(">"))
    assert (m, limit) == (32000, CAPACITY)
    retry = replay(app, record, {**record["body"], "max_tokens": limit - n - 1000})
    assert retry.status_code == 200, retry.text
    events = sse(retry)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    assert events[0][1]["message"]["usage"]["input_tokens"] == n
    open_block = None
    for name, data in events:  # blocks open, take deltas and close in order, one at a time
        if name == "content_block_start":
            assert open_block is None
            open_block = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_block
        elif name == "content_block_stop":
            assert data["index"] == open_block
            open_block = None
    assert open_block is None
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens")


def test_codexs_first_request_streams_a_completed_response(app):
    record = fixture("codex")
    kinds = [t["type"] for t in record["body"]["tools"]]
    assert "namespace" in kinds and "web_search" in kinds
    response = replay(app, record)
    assert response.status_code == 200, response.text
    events = sse(response)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"]
    added = [data["item"]["id"] for name, data in events if name == "response.output_item.added"]
    done = [data["item"]["id"] for name, data in events if name == "response.output_item.done"]
    assert added == done == [item["id"] for item in final["output"]]
