"""DESIGN.md's boundary: the front doors (server, commands, chat, bench) use `LLM`'s client interface
(generate, render_chat, tokenize, describe(), stats(), ...), never the engine core behind it, its runner,
its model or its tokenizer, which may live in another process (`LLM(engine_process=True)`, the CUDA
default); they do not probe the LLM with getattr / hasattr, nor import the engine's side of the runtime;
and the server's modules import each other without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trtedge"
# LLM attributes that are the runtime's, not the client's
INTERNALS = {"engine", "model", "draft", "tp", "tokenizer", "checkpoint", "bundle"}
# the engine's side of the runtime: its core, device code and models
ENGINE_SIDE = ("engine", "client", "core", "executor", "models", "ops", "speculative", "structured")
FRONT_DOORS = ("server/", "commands/", "chat/", "bench/", "cli.py")


def _is_llm(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("llm", "_llm")
    return isinstance(node, ast.Attribute) and node.attr in ("llm", "_llm")


def _probes_llm(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and bool(node.args)
        and _is_llm(node.args[0])
    )


def _engine_side(module: str) -> bool:
    parts = module.split(".")
    return parts[:2] == ["trtedge", "runtime"] and len(parts) > 2 and parts[2] in ENGINE_SIDE


def front_door_reaches() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("runtime/") or rel in ("llm.py", "llm_views.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Attribute):
                if node.attr == "runner" or (node.attr in INTERNALS and _is_llm(node.value)):
                    found.append(f"trtedge/{rel}:{node.lineno}: .{node.attr}")
            elif _probes_llm(node):  # the interface is LLM's methods and attributes, not a guess
                found.append(f"trtedge/{rel}:{node.lineno}: {node.func.id}(llm, ...)")
            elif not rel.startswith(FRONT_DOORS):
                continue
            elif isinstance(node, ast.ImportFrom) and _engine_side(node.module or ""):
                found.append(f"trtedge/{rel}:{node.lineno}: import {node.module}")
            elif isinstance(node, ast.Import):
                found += [
                    f"trtedge/{rel}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if _engine_side(a.name)
                ]
    return found


def test_front_doors_do_not_reach_past_the_llm_client_interface():
    assert front_door_reaches() == []


def test_the_check_sees_a_reach(tmp_path, monkeypatch):
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "bad.py").write_text(
        "from trtedge.runtime.executor.sampler import TokenLogprobs\n"
        "def f(llm, serving):\n"
        "    return llm.engine.runner.kv, serving.llm.tokenizer.decode([1])\n"
        "def g(self):\n"
        "    return getattr(self.llm, 'audio', None)\n"
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert sorted(front_door_reaches()) == [
        "trtedge/server/bad.py:1: import trtedge.runtime.executor.sampler",
        "trtedge/server/bad.py:3: .engine",
        "trtedge/server/bad.py:3: .runner",
        "trtedge/server/bad.py:3: .tokenizer",
        "trtedge/server/bad.py:5: getattr(llm, ...)",
    ]


def server_import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Cycles among the server's modules (every import counts, TYPE_CHECKING ones too)."""
    root = package / "server"
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("trtedge", *path.relative_to(package).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trtedge.server"):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("trtedge.server")}
        graph[name] = imported - {name}
    cycles, done = [], set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append(stack[stack.index(name) :] + [name])
            return
        if name in done or name not in graph:
            return
        for other in sorted(graph[name]):
            visit(other, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    return cycles


def test_the_server_modules_import_each_other_without_cycles():
    assert server_import_cycles() == []


def test_the_cycle_check_sees_one(tmp_path):
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "a.py").write_text("from trtedge.server.b import x\n")
    (tmp_path / "server" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trtedge.server.a import y\n"
    )
    assert server_import_cycles(tmp_path) == [["trtedge.server.a", "trtedge.server.b", "trtedge.server.a"]]
