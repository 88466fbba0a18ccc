"""The documentation site: the CLI and HTTP references are current with the code, every documentation page
is in the nav, and `mkdocs build --strict` passes (skipped where mkdocs is not installed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cli_reference_is_current():
    script = ROOT / "scripts" / "generate_cli_reference.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "cli-reference.md").read_text()
    for text in ("`trtedge serve`", "`--config`", "`trtedge cache prune`", "`--max-size-gb`"):
        assert text in page


def test_http_reference_is_current():
    script = ROOT / "scripts" / "generate_http_reference.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "http-reference.md").read_text()
    assert "## POST `/v1/chat/completions`" in page and "| `messages` |" in page


def test_every_committed_page_is_in_the_nav():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "docs/*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = [Path(p).relative_to("docs").as_posix() for p in tracked]  # nav paths are relative to docs/
    missing = sorted(p for p in pages if p not in nav)
    assert not missing, f"add to the nav in mkdocs.yml: {missing}"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "cli-reference" / "index.html").is_file()
    assert "generate_stream" in (tmp_path / "site" / "api-reference" / "index.html").read_text()


GUIDE_TABLES = {
    "trtedge chat": "cli.md",
    "trtedge build": "cli.md",
    "trtedge serve": "server.md",
    "trtedge bench run": "bench.md",
}


@pytest.mark.parametrize(("command", "page"), GUIDE_TABLES.items())
def test_guide_flag_tables_list_the_flags_of_the_code(command, page):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import generate_cli_reference as gen
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    text = (ROOT / "docs" / page).read_text()
    block = re.search(rf"<!-- flags: {command} -->\n(.*?)<!-- /flags -->", text, re.S)
    assert block, f"docs/{page} has no flags table for `{command}`"
    documented = set(re.findall(r"^\| `(--[\w-]+)`", block.group(1), re.M))
    code = {param.opts[0] for param in gen.flags(gen.commands()[command])}
    assert documented == code, f"docs only: {documented - code}; code only: {code - documented}"
    for param in gen.flags(gen.commands()[command]):
        row = next(x for x in block.group(1).splitlines() if x.startswith(f"| `{param.opts[0]}`"))
        assert gen._text(param.help or "") in row, f"{param.opts[0]}: the table's meaning is not its --help"


def test_the_exit_status_table_is_the_code_s():
    from trtedge.commands.exit_codes import MEANING

    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.search(r"<!-- exit-status -->\n(.*?)<!-- /exit-status -->", text, re.S)
    assert block, "docs/cli.md has no exit-status table"
    rows = dict(re.findall(r"^\| (\d+) \| (.*) \|$", block.group(1), re.M))
    assert {int(k) for k in rows} == set(MEANING)
    for code, meaning in MEANING.items():
        assert rows[str(code)] == " ".join(meaning.split())


def test_installation_says_what_the_torch_command_installs_and_how_to_get_the_cpu_build():
    page = (ROOT / "docs" / "installation.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 &&" in readme  # the README's command stays the one that works here
    assert "CPU PyTorch" not in readme
    assert re.search(
        r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu\n", page
    )
    assert "CUDA build" in page and "nvidia-*" in page


def test_the_dev_extra_has_what_the_docs_examples_need():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0] for r in extras["dev"]}
    for extra in ("bench", "vision"):  # --plot, and image and video input
        for requirement in extras[extra]:
            assert re.split(r"[<>=!;\[ ]", requirement, maxsplit=1)[0] in names, requirement
