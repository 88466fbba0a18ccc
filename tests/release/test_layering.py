"""DESIGN.md's boundary: the front doors (server, commands, chat, bench) use `LLM`'s client interface
(generate, describe(), stats(), ...), never the engine core behind it, its runner or its model, which
may live in another process (`LLM(engine_process=True)`, the CUDA default)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trtedge"
INTERNALS = {"engine", "model", "draft", "tp"}  # LLM attributes that are the runtime's, not the client's


def _is_llm(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("llm", "_llm")
    return isinstance(node, ast.Attribute) and node.attr in ("llm", "_llm")


def front_door_reaches() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("runtime/") or rel == "llm.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr == "runner" or (node.attr in INTERNALS and _is_llm(node.value)):
                found.append(f"trtedge/{rel}:{node.lineno}: .{node.attr}")
    return found


def test_front_doors_do_not_reach_past_the_llm_client_interface():
    assert front_door_reaches() == []


def test_the_check_sees_a_reach(tmp_path, monkeypatch):
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "bad.py").write_text("def f(llm):\n    return llm.engine.runner.kv\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert front_door_reaches() == ["trtedge/server/bad.py:2: .runner", "trtedge/server/bad.py:2: .engine"]
