"""Shell completions: completions/ is current with the Typer app (CI regenerates and diffs), the checked-in
bash script completes commands, flags and cached model names, and --install-completion works."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _env(tmp_path, **extra):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path)}
    env["TRTEDGE_CACHE_DIR"] = str(tmp_path / "cache")
    return {**env, **extra}


def test_completion_scripts_are_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "completions" / "generate"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr + "\n(run completions/generate and commit the scripts)"
    for name in ("trtedge.bash", "_trtedge", "trtedge.fish"):
        assert "_TRTEDGE_COMPLETE" in (ROOT / "completions" / name).read_text()


def _bash_complete(tmp_path, words: list[str]) -> list[str]:
    script = (
        f"source {ROOT / 'completions' / 'trtedge.bash'}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        "_trtedge_completion trtedge\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=_env(tmp_path))
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_script_completes_commands_flags_and_cached_models(tmp_path):
    assert "serve" in _bash_complete(tmp_path, ["trtedge", "se"])
    assert {"prune", "clear", "ls"} <= set(_bash_complete(tmp_path, ["trtedge", "cache", ""]))
    assert _bash_complete(tmp_path, ["trtedge", "serve", "--max-b"]) == ["--max-batch-size"]
    # a built bundle and a downloaded Hugging Face checkpoint in the cache
    bundle = tmp_path / "cache" / "bundles" / "k1"
    bundle.mkdir(parents=True)
    (bundle / "manifest.json").write_text(json.dumps({"model": "/models/tiny-llama", "profile": {}}))
    (tmp_path / "cache" / "checkpoints" / "models--Qwen--Qwen3-0.6B").mkdir(parents=True)
    assert _bash_complete(tmp_path, ["trtedge", "chat", ""]) == ["/models/tiny-llama", "Qwen/Qwen3-0.6B"]
    assert _bash_complete(tmp_path, ["trtedge", "serve", "Q"]) == ["Qwen/Qwen3-0.6B"]


def test_install_completion_writes_a_sourced_script(tmp_path):
    result = subprocess.run(
        # run from a bash parent, as a user would: the shell is detected from the parent process (a
        # second command keeps bash from exec-ing trtedge in its place)
        ["bash", "-c", f"{shlex.quote(str(BIN / 'trtedge'))} --install-completion; exit $?"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    installed = tmp_path / ".bash_completions" / "trtedge.sh"
    assert "_TRTEDGE_COMPLETE" in installed.read_text()
    assert str(installed) in (tmp_path / ".bashrc").read_text()
