"""Cache upgrades: the layout version is in the key; a newer trtedge ignores bundles of an older layout
(hand-made here, in shapes this version cannot read) and prune removes them instead of failing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.tiny import make_tiny_checkpoint
from trtedge.cli import app
from trtedge.runtime.artifacts.bundle import LAYOUT_VERSION, BuildProfile, cache_key, prepare_bundle
from trtedge.runtime.artifacts.cache import Cache

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def _old_bundle(cache_dir: Path, key: str, manifest: dict, size: int = 4096) -> Path:
    path = cache_dir / "bundles" / key
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"\0" * size)  # not a file this version knows
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _old_bundles(cache_dir: Path) -> dict[str, Path]:
    return {
        # before manifests recorded a layout: other field names, components as a list
        "unversioned": _old_bundle(cache_dir, "0ld0", {"model": "m", "components": ["llm"], "profile": "x"}),
        "previous": _old_bundle(
            cache_dir,
            "0ld1",
            {"layout_version": LAYOUT_VERSION - 1, "model": "m", "components": {"llm": {"weights": 3}}},
        ),
    }


def test_layout_version_is_in_the_key_and_the_manifest(tiny, tmp_path):
    fp = "f" * 64
    assert cache_key(fp, None, BuildProfile()) != cache_key(
        fp, None, BuildProfile(layout_version=LAYOUT_VERSION + 1)
    )
    bundle = prepare_bundle(str(tiny), cache_dir=tmp_path)
    try:
        assert bundle.manifest["layout_version"] == LAYOUT_VERSION
        assert bundle.manifest["profile"]["layout_version"] == LAYOUT_VERSION
    finally:
        bundle.release()


def test_new_version_ignores_old_bundles_and_its_prune_removes_them(tiny, tmp_path):
    old = _old_bundles(tmp_path)
    newer = _old_bundle(tmp_path, "n3w", {"layout_version": LAYOUT_VERSION + 1, "model": "m"})
    entries = {e.key: e for e in Cache(tmp_path).entries()}
    assert entries["0ld0"].outdated and entries["0ld1"].outdated and not entries["n3w"].outdated

    bundle = prepare_bundle(str(tiny), cache_dir=tmp_path)  # builds its own, then prunes (far under the cap)
    try:
        assert bundle.built and bundle.key not in ("0ld0", "0ld1")
        assert not any(p.exists() for p in old.values())
        assert newer.exists()  # a newer trtedge sharing the cache still reads it
    finally:
        bundle.release()


def test_cache_cli_lists_and_prunes_old_bundles(tmp_path):
    old = _old_bundles(tmp_path)
    listed = runner.invoke(app, ["cache", "ls", "--json", "--cache-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert {e["key"]: e["outdated"] for e in json.loads(listed.output)} == {"0ld0": True, "0ld1": True}
    table = runner.invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)], terminal_width=200)
    assert table.exit_code == 0 and "old layout 0" in table.output

    dry = runner.invoke(app, ["cache", "prune", "--dry-run", "--cache-dir", str(tmp_path)])
    assert dry.exit_code == 0 and "would evict 0ld0" in dry.output and all(p.exists() for p in old.values())

    in_use = Cache(tmp_path).lock("0ld1", "use")
    in_use.acquire(shared=True)  # another process still has it loaded
    try:
        pruned = runner.invoke(app, ["cache", "prune", "-v", "--cache-dir", str(tmp_path)])
    finally:
        in_use.release()
    assert pruned.exit_code == 0, pruned.output
    assert not old["unversioned"].exists() and old["previous"].exists()
    assert runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path)]).exit_code == 0
    assert not old["previous"].exists()


def test_a_layout_3_bundle_of_a_k_quant_gguf_is_rebuilt_not_read(tmp_path):
    """Layout 3 stored a Q4_K_M file's blocks requantized to int4 under --weights auto; layout 4 keeps
    them as "gguf" tensors. A layout-3 bundle at the key layout 3 computed for the same file and
    profile is what an older trtedge left: this one must build its own, and prune the old one."""
    from benchmarks.cpu_scale import Geometry, write_gguf
    from trtedge.runtime.artifacts.bundle import fingerprint

    assert LAYOUT_VERSION >= 4
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_gguf(path, Geometry("tiny", "llama", 256, 512, 1, 4, 2, 600, False, False, 10000.0), "q4_k_m")
    cache_dir = tmp_path / "cache"
    old = prepare_bundle(str(path), BuildProfile(weights="int4", layout_version=3), cache_dir=cache_dir)
    old.release()
    old_auto = cache_key(fingerprint(path)[0], None, BuildProfile(layout_version=3))
    manifest = json.loads((old.path / "manifest.json").read_text())
    manifest["profile"]["weights"] = "auto"  # what layout 3 wrote for auto: int4 weights
    (old.path / "manifest.json").write_text(json.dumps(manifest))
    old_path = old.path.rename(old.path.parent / old_auto)
    assert "int4" in manifest["components"]["llm"]["weights"]["quantization"]["tensors"]

    stale = prepare_bundle(str(path), BuildProfile(layout_version=3), cache_dir=cache_dir)
    try:  # without the bump, this is the bundle a launch would have read
        assert not stale.built and stale.key == old_auto
    finally:
        stale.release()
    bundle = prepare_bundle(str(path), cache_dir=cache_dir)
    try:
        assert bundle.built and bundle.key != old_auto
        tensors = bundle.manifest["components"]["llm"]["weights"]["quantization"]["tensors"]
        assert tensors.get("gguf", 0) > 0 and "int4" not in tensors
        assert not old_path.exists()  # pruned: an older layout goes whatever the cap
    finally:
        bundle.release()
