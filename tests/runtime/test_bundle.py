"""Runtime bundles: cache keys, reuse without rebuilding, atomic publish, locks, LRU prune, clear."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, ConfigError, SamplingParams, clear_engine_cache, prune_engine_cache
from trtedge.runtime.artifacts import builder
from trtedge.runtime.artifacts.bundle import (
    BuildProfile,
    Bundle,
    BundleError,
    cache_key,
    fingerprint,
    prepare_bundle,
)
from trtedge.runtime.artifacts.cache import Cache, FileLock

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    return tmp_path / "cache"


def _key(path: Path, profile: BuildProfile | None = None) -> str:
    return cache_key(fingerprint(path)[0], None, profile or BuildProfile())


def _no_build(*args, **kwargs):
    raise AssertionError("the builder ran on a cache hit")


# ---- keys -------------------------------------------------------------------------------------------
def test_copy_keeps_key_config_and_sampled_weight_byte_change_it(tiny, tmp_path):
    copy = shutil.copytree(tiny, tmp_path / "elsewhere" / "renamed")
    assert _key(copy) == _key(tiny)

    edited = shutil.copytree(tiny, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (edited / "config.json").write_text(json.dumps(config))
    assert _key(edited) != _key(tiny)

    flipped = shutil.copytree(tiny, tmp_path / "flipped")
    weights = flipped / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 100] ^= 0xFF  # first payload bytes are always sampled
    weights.write_bytes(bytes(data))
    assert _key(flipped) != _key(tiny)


@pytest.mark.parametrize(
    "change",
    [
        dict(max_input_len=1024),
        dict(max_kv_cache_capacity=4096),
        dict(max_batch_size=4),
        dict(dtype="bfloat16"),
        dict(weights="int8"),
        dict(speculative_method="draft_model"),
        dict(weights="int4"),
        dict(weights="bf16"),
        dict(layout_version=99),
    ],
)
def test_every_profile_field_changes_key(tiny, change):
    assert _key(tiny, BuildProfile(**change)) != _key(tiny)


def test_profile_and_speculative_config_are_validated():
    with pytest.raises(BundleError, match="--speculative-config"):
        BuildProfile.create(speculative="{not json")
    with pytest.raises(BundleError, match="needs model"):
        BuildProfile.create(speculative={"method": "draft_model"})
    with pytest.raises(BundleError, match="--components"):
        BuildProfile.create(components="llm,speech")
    with pytest.raises(BundleError, match="draft model"):
        BuildProfile.create(components="draft")
    # "all" names the vision encoder and the speech components too; a model without them drops them (text
    # models' keys stay as they were)
    text, vlm = {"model_type": "llama"}, {"model_type": "qwen2_5_vl", "vision_config": {}}
    speech = ("talker", "code_predictor", "code2wav")
    assert BuildProfile.create(components="all").components == ("llm", "vision", *speech)
    omni = {
        "model_type": "qwen3_omni_moe",
        "thinker_config": {},
        "talker_config": {"x": 1},
        "code2wav_config": {"x": 1},
    }
    assert BuildProfile.create(components="all").fit(omni).components == ("llm", "vision", *speech)
    muted = {**omni, "enable_audio_output": False}
    assert BuildProfile.create(components="all").fit(muted).components == ("llm", "vision")
    with pytest.raises(BundleError, match="go together"):
        BuildProfile.create(components="llm,talker")
    with pytest.raises(BundleError, match="needs llm"):
        BuildProfile.create(components="talker,code_predictor,code2wav")
    assert BuildProfile.create(components="all").fit(text).components == ("llm",)
    assert BuildProfile.create(components="all").fit(vlm).components == ("llm", "vision")
    profile = BuildProfile.create(components="all", speculative={"method": "draft_model", "model": "x"})
    assert profile.fit(text).components == ("llm", "draft")
    ngram = BuildProfile.create(components="all", speculative={"method": "ngram"})
    assert ngram.fit(text) == BuildProfile()  # no draft: the plain bundle


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True])
def test_engine_cache_max_size_gb_refuses_non_positive_and_non_finite(bad):
    from trtedge.config import LaunchConfig

    with pytest.raises(ConfigError, match="--engine-cache-max-size-gb"):
        LaunchConfig(engine_cache_max_size_gb=bad)


# ---- reuse ------------------------------------------------------------------------------------------
def test_second_launch_reuses_bundle_moved_copy_too_and_edit_rebuilds(tiny, cache_dir, tmp_path, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0)
    kwargs = dict(cache_dir=str(cache_dir), max_kv_cache_capacity=256, max_input_len=128)
    original = shutil.copytree(tiny, tmp_path / "original")
    with LLM(str(original), **kwargs) as first:
        assert first.bundle.built
        expected = first.generate("w5 w6 w7", params).token_ids
        key = first.bundle.key
    manifest = json.loads((cache_dir / "bundles" / key / "manifest.json").read_text())
    weights = manifest["components"]["llm"]["weights"]
    assert weights["externalized"] and list(weights["files"]) == ["model.safetensors"]
    assert not list((cache_dir / "bundles" / key).glob("*.safetensors"))  # weights are not copied

    with monkeypatch.context() as m:
        m.setattr(builder, "build_bundle", _no_build)
        with LLM(str(original), **kwargs) as again:
            assert (again.bundle.key, again.bundle.built) == (key, False)
            assert again.generate("w5 w6 w7", params).token_ids == expected
        moved = shutil.move(original, tmp_path / "elsewhere" / "moved")
        with LLM(str(moved), **kwargs) as llm:
            assert (llm.bundle.key, llm.bundle.built) == (key, False)
            assert llm.generate("w5 w6 w7", params).token_ids == expected

    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (moved / "config.json").write_text(json.dumps(config))
    with LLM(str(moved), **kwargs) as edited:
        assert edited.bundle.built and edited.bundle.key != key


def test_externalized_weights_are_verified_on_load(tiny, cache_dir, tmp_path):
    copy = shutil.copytree(tiny, tmp_path / "copy")
    bundle = prepare_bundle(str(copy), cache_dir=cache_dir)
    bundle.release()
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last bytes are always sampled too
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="changed since the bundle"):
        next(Bundle(bundle.path, checkpoint_path=copy).iter_tensors())


def test_clear_engine_cache_flag_rebuilds(tiny, cache_dir):
    kwargs = dict(cache_dir=str(cache_dir), max_kv_cache_capacity=256, max_input_len=128)
    LLM(str(tiny), **kwargs).close()
    with LLM(str(tiny), clear_engine_cache=True, **kwargs) as llm:
        assert llm.bundle.built


def test_smollm2_second_launch_does_no_conversion(cache_dir, monkeypatch):
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    kwargs = dict(cache_dir=str(cache_dir), max_kv_cache_capacity=1024, max_input_len=512)
    start = time.perf_counter()
    with LLM(**kwargs) as llm:
        first = time.perf_counter() - start
        assert llm.bundle.built and llm.model_name == "SmolLM2-135M-Instruct"
        assert (llm.bundle.path / "weights.safetensors").is_file()
        assert llm.bundle.quantization["dominant"] == "Q4_1"
        answer = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=12, temperature=0),
        )
    monkeypatch.setattr(builder, "build_bundle", _no_build)
    start = time.perf_counter()
    with LLM(**kwargs) as llm:
        second = time.perf_counter() - start
        assert not llm.bundle.built
        quant = llm.bundle.manifest["components"]["llm"]["weights"]["quantization"]
        assert quant["tensors"] == {
            "int4": 210,
            "gguf": 1,
            "float": 61,
        }  # Q4_1 as int4, Q8_0 embedding as its blocks
        again = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=12, temperature=0),
        )
    assert again.text == answer.text and "Paris" in answer.text
    print(f"\nSmolLM2 launch: first (build) {first:.2f} s, second (cache hit) {second:.2f} s")


# ---- processes: concurrency and kill -9 ----------------------------------------------------------------
_BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from trtedge.runtime.artifacts.bundle import prepare_bundle
    bundle = prepare_bundle(sys.argv[1], cache_dir=sys.argv[2])
    print("built" if bundle.built else "reused", bundle.key, flush=True)
    """
)


def _spawn(tiny: Path, cache_dir: Path, delay: float) -> subprocess.Popen:
    env = dict(os.environ, TRTEDGE_TEST_BUILD_DELAY=str(delay), PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", _BUILD_SCRIPT, str(tiny), str(cache_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_build_once_and_both_succeed(tiny, cache_dir):
    procs = [_spawn(tiny, cache_dir, delay=3) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    words = sorted(out.split()[0] for out, _ in outputs)
    assert words == ["built", "reused"]
    assert len({out.split()[1] for out, _ in outputs}) == 1
    assert len(list((cache_dir / "bundles").iterdir())) == 1


# ---- eviction -----------------------------------------------------------------------------------------
def _bundles(tiny: Path, cache_dir: Path, n: int) -> list[str]:
    keys = []
    for i in range(n):
        bundle = prepare_bundle(str(tiny), BuildProfile(max_batch_size=i + 1), cache_dir=cache_dir)
        bundle.release()
        os.utime(bundle.path / "manifest.json", (1000.0 + i, 1000.0 + i))  # oldest first
        keys.append(bundle.key)
    return keys


def test_prune_evicts_oldest_first_keeps_active_and_checkpoints(tiny, cache_dir):
    keys = _bundles(tiny, cache_dir, 4)
    (cache_dir / "checkpoints" / "org--model").mkdir(parents=True)
    (cache_dir / "checkpoints" / "org--model" / "model.safetensors").write_bytes(b"x" * 10_000_000)
    (cache_dir / "kernels").mkdir(exist_ok=True)
    (cache_dir / "kernels" / "k.so").write_bytes(b"x" * 1000)
    sizes = {e.key: e.size_bytes for e in Cache(cache_dir).entries()}

    active = Bundle(cache_dir / "bundles" / keys[0])  # the oldest, but loaded by "another process"
    lock = FileLock(cache_dir / "locks" / f"{keys[0]}.use")
    assert lock.acquire(shared=True)
    try:
        cap_gb = (sizes[keys[0]] + sizes[keys[3]] + 1) / 2**30
        removed = prune_engine_cache(cap_gb, cache_dir=cache_dir)
    finally:
        lock.release()
    assert [e.key for e in removed] == keys[1:3]
    assert sorted(p.name for p in (cache_dir / "bundles").iterdir()) == sorted([keys[0], keys[3]])
    assert active.path.is_dir()
    assert (cache_dir / "checkpoints" / "org--model" / "model.safetensors").is_file()
    assert (cache_dir / "kernels" / "k.so").is_file()


def test_prepare_evicts_past_cap_but_never_the_bundle_it_returns(tiny, cache_dir):
    keys = _bundles(tiny, cache_dir, 2)
    bundle = prepare_bundle(str(tiny), BuildProfile(max_batch_size=9), cache_dir=cache_dir, max_size_gb=1e-9)
    bundle.release()
    assert [p.name for p in (cache_dir / "bundles").iterdir()] == [bundle.key]
    assert bundle.key not in keys


def test_clear_keeps_checkpoints_and_bundles_in_use(tiny, cache_dir):
    keys = _bundles(tiny, cache_dir, 2)
    (cache_dir / "checkpoints").mkdir()
    (cache_dir / "checkpoints" / "keep").write_text("x")
    held = prepare_bundle(str(tiny), BuildProfile(max_batch_size=1), cache_dir=cache_dir)
    try:
        removed = clear_engine_cache(cache_dir)
    finally:
        held.release()
    assert [e.key for e in removed] == [keys[1]]
    assert (cache_dir / "checkpoints" / "keep").is_file()
    assert [e.key for e in clear_engine_cache(cache_dir)] == [keys[0]]
    assert not list((cache_dir / "bundles").iterdir())


def test_read_only_cache_still_loads_a_built_bundle(tiny, cache_dir, monkeypatch):
    prepare_bundle(str(tiny), cache_dir=cache_dir).release()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(FileLock, "acquire", read_only)
    monkeypatch.setattr(os, "utime", read_only)
    monkeypatch.setattr(builder, "build_bundle", _no_build)
    bundle = prepare_bundle(str(tiny), cache_dir=cache_dir)
    assert not bundle.built and bundle.load_tokenizer()


def test_disk_full_during_build_is_one_line_and_leaves_no_temp_dir(tiny, cache_dir, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(builder, "_write", disk_full)
    with pytest.raises(BundleError, match="No space left on device"):
        prepare_bundle(str(tiny), cache_dir=cache_dir)
    assert not list((cache_dir / "bundles").iterdir())


def test_only_indexed_shards_are_weights(tiny, cache_dir, tmp_path):
    sharded = shutil.copytree(tiny, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(sharded / "model-00001-of-00001.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(sharded / "model-00001-of-00001.safetensors", sharded / "consolidated.safetensors")
    bundle = prepare_bundle(str(sharded), cache_dir=cache_dir)
    bundle.release()
    assert list(bundle.section["weights"]["files"]) == ["model-00001-of-00001.safetensors"]
    assert sorted(name for name, _ in bundle.iter_tensors()) == sorted(names)


def test_draft_component_follows_a_moved_draft(tiny, cache_dir, tmp_path):
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    first = prepare_bundle(
        str(tiny), BuildProfile.create(components="all", speculative=spec), cache_dir=cache_dir
    )
    first.release()
    assert first.built and first.draft is not None
    moved = shutil.move(draft, tmp_path / "moved-draft")
    spec["model"] = str(moved)
    again = prepare_bundle(
        str(tiny), BuildProfile.create(components="all", speculative=spec), cache_dir=cache_dir
    )
    again.release()
    assert (again.key, again.built) == (first.key, False)
    assert "model.embed_tokens.weight" in dict(again.draft.iter_tensors())
