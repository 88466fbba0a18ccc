"""Runtime bundles: build profile, content fingerprint, cache key, find-or-build with atomic publish.

A bundle is what a launch loads instead of the checkpoint: converted weights (or the checkpoint's
own safetensors, verified by fingerprint), tokenizer, template and manifest.json. See
``bundle_cache`` for the directory layout, locks and eviction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trtedge.runtime.artifacts.cache import (  # noqa: F401 - clear/prune are public here too
    DEFAULT_MAX_SIZE_GB,
    LAYOUT_VERSION,
    BundleError,
    Cache,
    CachedBundle,
    FileLock,
    check_max_size_gb,
    clear_engine_cache,
    prune_engine_cache,
)
from trtedge.runtime.artifacts.choices import DTYPES, WEIGHTS
from trtedge.runtime.artifacts.prequantized import Scheme
from trtedge.runtime.speculative.config import METHODS, SpeculativeConfig, SpeculativeConfigError

log = logging.getLogger("trtedge")

COMPONENTS = ("llm", "draft", "vision", "talker", "code_predictor", "code2wav")
# speech output (Qwen3-Omni): the Talker, its code predictor and the Code2Wav vocoder, built and loaded together
SPEECH_COMPONENTS = ("talker", "code_predictor", "code2wav")
# families whose media encoder (the "vision" component: a vision tower, or Qwen3-ASR's audio tower) trtedge
# builds and runs, and the config.json field that describes it
VISION_MODEL_TYPES = {
    "qwen2_5_vl": "vision_config",
    "qwen3_vl": "vision_config",
    "qwen3_asr": "audio_config",
    "qwen2_5_omni": "thinker_config",
    "qwen2_5_omni_thinker": "audio_config",
    "qwen3_omni_moe": "thinker_config",
    "qwen3_omni_moe_thinker": "audio_config",
    "nemotron_h_omni": "vision_config",
}

_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024
_GGUF_HEADER_BYTES = 16 * 2**20
# Files of an HF directory that change what the runtime does; everything else (README, .git*) is ignored.
TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "hf_quant_config.json",  # ModelOpt's record of a pre-quantized checkpoint
    "processor_config.json",
)


# ---- build profile --------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildProfile:
    """Everything that changes a bundle's contents or what it was built for."""

    max_input_len: int = 4096
    max_kv_cache_capacity: int = 8192
    max_batch_size: int = 1
    dtype: str = "auto"
    weights: str = "auto"
    speculative_method: str | None = None
    draft_model: str | None = None  # shown only: the draft's fingerprint goes into the key
    components: tuple[str, ...] = ("llm",)
    layout_version: int = LAYOUT_VERSION
    tensor_parallel_size: int = 1  # each rank loads its slice of the same weights

    def __post_init__(self) -> None:
        for name in ("max_input_len", "max_kv_cache_capacity", "max_batch_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BundleError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise BundleError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise BundleError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        unknown = [c for c in self.components if c not in COMPONENTS]
        if unknown or not self.components:
            raise BundleError(
                f"--components must name some of {', '.join(COMPONENTS)} (or all), got {unknown}"
            )
        if self.speculative_method is not None and self.speculative_method not in METHODS:
            raise BundleError(
                f"--speculative-config method must be one of {', '.join(METHODS)}, "
                f"got {self.speculative_method!r}"
            )
        if "vision" in self.components and "llm" not in self.components:
            raise BundleError(
                "--components vision needs llm too (the vision encoder feeds the language model)"
            )
        speech = [c for c in SPEECH_COMPONENTS if c in self.components]
        if speech and "llm" not in self.components:
            raise BundleError(
                f"--components {speech[0]} needs llm too (the Talker speaks the language model's text)"
            )
        if speech and len(speech) != len(SPEECH_COMPONENTS):
            raise BundleError(
                f"--components {', '.join(SPEECH_COMPONENTS)} go together (speech output needs all three)"
            )
        if "draft" in self.components and not self.draft_model:
            raise BundleError("--components draft needs a draft model in --speculative-config")

    @classmethod
    def create(cls, *, components: str | Iterable[str] = "llm", speculative: dict | str | None = None, **kw):
        """A profile from CLI-style values: components "all" or "llm,draft", speculative as JSON or dict.
        Only method draft_model pairs a draft checkpoint with the bundle."""
        spec = parse_speculative(speculative)
        draft = spec.model if spec is not None and spec.method == "draft_model" else None
        if isinstance(components, str):
            names = [c.strip() for c in components.split(",") if c.strip()]
        else:
            names = list(components)
        names = ["vision" if n == "audio" else n for n in names]  # an audio model's encoder component
        if names == ["all"]:  # vision and speech are dropped again for a model without them
            names = (["llm", "draft", "vision"] if draft else ["llm", "vision"]) + list(SPEECH_COMPONENTS)
        return cls(
            speculative_method="draft_model" if draft else None,  # what a launch with it looks up
            draft_model=draft,
            components=tuple(dict.fromkeys(names)),
            **kw,
        )

    @classmethod
    def from_launch(cls, config) -> BuildProfile:
        """The profile of a LaunchConfig: the LLM, paired with the draft checkpoint for draft_model."""
        spec = config.speculative
        paired = spec is not None and spec.method == "draft_model"
        vision = getattr(config, "components", "all") == "all"
        return cls(
            max_input_len=config.max_input_len,
            max_kv_cache_capacity=config.max_kv_cache_capacity,
            max_batch_size=config.max_batch_size,
            dtype=config.dtype,
            weights=config.weights,
            tensor_parallel_size=config.tensor_parallel_size,
            speculative_method="draft_model" if paired else None,
            draft_model=spec.model if paired else None,
            components=(("llm", "draft") if paired else ("llm",))
            + (("vision", *SPEECH_COMPONENTS) if vision else ()),
        )

    def fit(self, config: dict | None) -> BuildProfile:
        """This profile for a checkpoint with ``config`` (config.json): without "vision" unless the model
        has a vision encoder trtedge runs (text models keep the keys they always had)."""
        field = VISION_MODEL_TYPES.get((config or {}).get("model_type"))
        drop = set()
        if field is None or field not in config:
            drop.add("vision")
        if not has_speech_output(config):
            drop.update(SPEECH_COMPONENTS)
        if not drop & set(self.components):
            return self
        return replace(self, components=tuple(c for c in self.components if c not in drop))

    def key_fields(self) -> dict:
        fields = asdict(self)
        fields.pop("draft_model")
        if self.tensor_parallel_size == 1:  # keys of single-device bundles stay as they were
            fields.pop("tensor_parallel_size")
        fields["components"] = list(self.components)
        return fields

    def summary(self) -> str:
        text = (
            f"in={self.max_input_len} kv={self.max_kv_cache_capacity} batch={self.max_batch_size} "
            f"dtype={self.dtype} weights={self.weights}"
        )
        if self.speculative_method:
            text += f" spec={self.speculative_method}"
        if self.tensor_parallel_size > 1:
            text += f" tp={self.tensor_parallel_size}"
        return text


def has_speech_output(config: dict | None) -> bool:
    """Whether a checkpoint's config.json describes speech output trtedge runs (Qwen3-Omni's Talker)."""
    config = config or {}
    return (
        config.get("model_type") == "qwen3_omni_moe"
        and bool(config.get("talker_config"))
        and bool(config.get("code2wav_config"))
        and config.get("enable_audio_output", True) is not False
    )


def parse_speculative(value) -> SpeculativeConfig | None:
    """--speculative-config (JSON text, a dict or a SpeculativeConfig) -> a validated config or None."""
    try:
        return SpeculativeConfig.coerce(value)
    except SpeculativeConfigError as e:
        raise BundleError(str(e)) from None


# ---- fingerprints and keys --------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    """Content digest: text files in full; safetensors header + sampled payload; GGUF head + samples."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        suffix = path.suffix.lower()
        if suffix == ".safetensors":
            head = f.read(8)
            start = min(size, 8 + int.from_bytes(head, "little")) if len(head) == 8 else size
        elif suffix == ".gguf":
            start = min(size, _GGUF_HEADER_BYTES)
        else:
            start = size
        f.seek(0)
        h.update(f.read(start))
        span = size - start
        if span <= _SAMPLES * _SAMPLE_BYTES:
            h.update(f.read())
        else:
            step = (span - _SAMPLE_BYTES) / (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(start + int(i * step))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def checkpoint_files(path: Path) -> dict[str, Path]:
    """The files that make up a checkpoint, by name relative to its root (a GGUF file is the root)."""
    if path.is_file():
        return {"model" + path.suffix.lower(): path}
    files = {name: path / name for name in TEXT_FILES if (path / name).is_file()}
    for file in sorted(path.glob("additional_chat_templates/*.jinja")):
        files[file.relative_to(path).as_posix()] = file
    from trtedge.runtime.artifacts.checkpoint import safetensors_files

    for file in safetensors_files(path):  # the index's shards when there is one (not consolidated.*)
        files[file.name] = file
    return files


def fingerprint(path: Path) -> tuple[str, dict[str, str]]:
    """(checkpoint digest, per-file digests); names are relative, so a moved copy fingerprints the same."""
    digests = {name: file_digest(file) for name, file in checkpoint_files(path).items()}
    return digest_json(digests), digests


def cache_key(checkpoint_fp: str, draft_fp: str | None, profile: BuildProfile) -> str:
    return digest_json({"checkpoint": checkpoint_fp, "draft": draft_fp, "profile": profile.key_fields()})[:24]


def digest_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# ---- loaded bundles --------------------------------------------------------------------------------
class BundleComponent:
    """One model of a bundle (the LLM or the draft), loadable like a Checkpoint."""

    def __init__(self, path: Path, section: dict, name: str, checkpoint_path: Path | None = None):
        self.path = path
        self.section = section
        self.source = name
        self.config = section["config"]
        self.quantization = section.get("quantization") or {}
        self.scheme = Scheme(**section["prequantized"]) if section.get("prequantized") else None
        self.kind = section["checkpoint"]["kind"]
        # externalized weights are read from where the checkpoint is now (it may have moved since the build)
        self.checkpoint_path = checkpoint_path or Path(section["checkpoint"]["path"])

    @property
    def name(self) -> str:
        return self.source

    @property
    def model_config(self):
        from trtedge.runtime.models.config import ModelConfig

        return ModelConfig.from_hf(self.config, source=str(self.path))

    def weight_files(self) -> list[Path]:
        weights = self.section["weights"]
        if not weights["externalized"]:
            return [self.path / name for name in weights["files"]]
        files = []
        for name, digest in weights["files"].items():
            file = self.checkpoint_path / name
            if not file.is_file() or file_digest(file) != digest:
                raise BundleError(
                    f"{file}: missing or changed since the bundle in {self.path} was built; "
                    "run `trtedge cache clear` or launch again to rebuild"
                )
            files.append(file)
        return files

    def iter_tensors(self, skip: Container[str] = ()) -> Iterator[tuple[str, object]]:
        """(name, tensor); quantized weights come whole, as ``QuantizedTensor``s under their plain name.
        Tensors named in ``skip`` are not read. The tensors are memory maps of the files (``mapped``)."""
        from trtedge.runtime.artifacts.mapped import mapped_tensors
        from trtedge.runtime.artifacts.quantize import gather

        for file in self.weight_files():
            yield from gather(mapped_tensors(file, skip)).items()

    def load_tokenizer(self):
        from trtedge.runtime.text.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path)


class Bundle(BundleComponent):
    """A published bundle: ``key``, ``path``, ``manifest``; the LLM component's checkpoint interface;
    ``draft`` when built with one. Holds a shared lock until ``release()`` so that no prune removes it."""

    def __init__(
        self,
        path: Path,
        name: str | None = None,
        checkpoint_path: Path | None = None,
        draft_path: Path | None = None,
    ):
        self.manifest = json.loads((path / "manifest.json").read_text())
        comps = self.manifest["components"]
        super().__init__(path, comps["llm"], name or self.manifest["model"], checkpoint_path)
        self.key = path.name
        self.built = False
        self.draft = None
        if "draft" in comps:
            self.draft = BundleComponent(path / "draft", comps["draft"], comps["draft"]["model"], draft_path)
        # the vision encoder's weights: the checkpoint's own files, or converted ones under vision/
        self.vision = None
        if "vision" in comps:
            self.vision = BundleComponent(path / "vision", comps["vision"], self.source, checkpoint_path)
        # speech output: the Talker, code predictor and Code2Wav weights (each the checkpoint's or converted)
        self.speech = {
            name: BundleComponent(path / name, comps[name], self.source, checkpoint_path)
            for name in SPEECH_COMPONENTS
            if name in comps
        }
        self._lock: FileLock | None = None

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    @property
    def has_speech(self) -> bool:
        return len(self.speech) == len(SPEECH_COMPONENTS)

    def iter_tensors(self, skip: Container[str] = ()) -> Iterator[tuple[str, object]]:
        from trtedge.runtime.multimodal import is_encoder_tensor

        if self.vision is None:
            yield from super().iter_tensors(skip)
            return
        yield from ((n, t) for n, t in super().iter_tensors(skip) if not is_encoder_tensor(n))
        yield from ((n, t) for n, t in self.vision.iter_tensors() if is_encoder_tensor(n))

    def touch(self) -> None:
        try:
            os.utime(self.path / "manifest.json")
        except OSError as e:  # a read-only cache (e.g. baked into an image) still loads
            log.debug("cannot update the last-used time of %s (%s)", self.path, e)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def validate(self) -> None:
        """Cheap structural load: tokenizer, weight headers, the tensors every model needs."""
        from safetensors import safe_open

        from trtedge.runtime.artifacts.quantize import quantized_name

        self.load_tokenizer()
        for component in (self, self.draft):
            if component is None:
                continue
            names = set()
            for file in component.weight_files():
                with safe_open(str(file), framework="pt") as f:
                    names.update((quantized_name(n) or (n,))[0] for n in f.keys())
            embeddings = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
            embeddings += ("backbone.embeddings.weight", "model.embeddings.weight")  # Nemotron-H
            embeddings += ("decoder.embedding.weight",)  # a transducer's prediction network
            embeddings += (
                "language_model.backbone.embeddings.weight",
                "language_model.model.embeddings.weight",
            )
            if not names & {*embeddings, *(f"thinker.{e}" for e in embeddings)}:  # Qwen2.5-Omni: thinker.
                raise BundleError(f"{component.path}: bundle weights lack model.embed_tokens.weight")
            component.model_config  # noqa: B018 - raises on an unsupported config


# ---- prepare: find or build -------------------------------------------------------------------------
@dataclass
class _Source:
    name: str
    path: Path
    checkpoint: object | None  # a resolved Checkpoint, or None when resolving is deferred (GGUF)


def _locate(model, cache: Cache) -> _Source:
    """Find the checkpoint path without parsing a GGUF file (that costs seconds and a hit needs none)."""
    from trtedge.runtime.artifacts.checkpoint import local_gguf, resolve_checkpoint
    from trtedge.runtime.artifacts.embedded import EMBEDDED_MODEL_NAME, embedded_model_path

    if model is None or str(model) == "":
        return _Source(EMBEDDED_MODEL_NAME, embedded_model_path(), None)
    gguf = local_gguf(Path(str(model)).expanduser())
    if gguf is not None:  # a .gguf file, or a directory holding one
        return _Source(str(model), gguf, None)
    checkpoint = resolve_checkpoint(model, cache.root)
    return _Source(checkpoint.name, checkpoint.path, checkpoint)


def _resolve(model, source: _Source, cache: Cache):
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint

    if source.checkpoint is None:
        source.checkpoint = resolve_checkpoint(model if model else None, cache.root)
    return source.checkpoint


def prepare_bundle(
    model: str | os.PathLike | None,
    profile: BuildProfile | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    max_size_gb: float = DEFAULT_MAX_SIZE_GB,
    clear: bool = False,
    progress: Callable[[str, int, int | None], None] | None = None,
) -> Bundle:
    """Find the bundle of ``model`` for ``profile`` or build and publish it; then evict past the cap.

    The returned bundle holds a shared lock (no prune removes it) until ``release()``.
    """
    from trtedge.runtime.artifacts import builder

    profile = profile or BuildProfile()
    max_bytes = check_max_size_gb(max_size_gb) * 2**30
    cache = Cache(cache_dir)
    if clear:
        cache.clear()
    source = _locate(model, cache)
    profile = profile.fit(_read_config(source.path))
    fp, files = fingerprint(source.path)
    draft_source = draft_fp = draft_path = None
    if profile.draft_model:
        draft_source = _locate(profile.draft_model, cache)
        draft_path = draft_source.path
        draft_fp = fingerprint(draft_path)[0]
    key = cache_key(fp, draft_fp, profile)
    target = cache.bundle_dir(key)
    use = cache.lock(key, "use")
    try:
        use.acquire(shared=True)  # waits while a prune is deleting this very bundle
    except OSError as e:  # read-only cache: nothing can evict from it either
        log.debug("cannot lock %s (%s); using the cache read-only", use.path, e)
    try:
        built = False
        if not (target / "manifest.json").is_file():

            def build(tmp: Path) -> None:
                if progress:
                    progress("read", 0, None)
                checkpoint = _resolve(model, source, cache)
                draft = _resolve(profile.draft_model, draft_source, cache) if draft_source else None
                builder.build_bundle(
                    checkpoint,
                    profile,
                    tmp,
                    fingerprint=(fp, files),
                    draft=draft,
                    cache=cache,
                    progress=progress,
                )
                Bundle(tmp, source.name, source.path, draft_path).validate()

            try:
                built = _build_once(cache, key, build)
            except OSError as e:  # disk full, read-only cache: one line; no half bundle is left
                raise BundleError(f"{cache.bundles}: cannot build bundle {key} ({e.strerror or e})") from e
        bundle = Bundle(target, source.name, source.path, draft_path)
        bundle.built = built
        bundle._lock = use
        bundle.touch()
    except BaseException:
        use.release()
        raise
    try:
        evicted = cache.prune(max_bytes, keep={key})
    except OSError as e:
        log.warning("could not evict bundles from %s (%s)", cache.bundles, e)
        evicted = []
    for e in evicted:
        log.info("evicted bundle %s (%s, %.1f MiB)", e.key, e.model, e.size_bytes / 2**20)
    return bundle


def _read_config(path: Path) -> dict | None:
    try:
        return json.loads((path / "config.json").read_text()) if path.is_dir() else None
    except (OSError, ValueError):
        return None  # resolving the checkpoint reports it


def _build_once(cache: Cache, key: str, build: Callable[[Path], None]) -> bool:
    """Build under the bundle's lock unless a concurrent builder published it meanwhile; True if built."""
    target = cache.bundle_dir(key)
    lock = cache.lock(key, "build")
    if not lock.acquire(blocking=False):
        log.warning("another process is building bundle %s; waiting for it", key)
        lock.acquire()
    try:
        if (target / "manifest.json").is_file():
            return False
        for stale in cache.bundles.glob(f".tmp-{key}-*"):  # left by a killed build: we hold its lock now
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache.temp_dir(key)
        try:
            build(tmp)
            _publish(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    finally:
        lock.release()


def _publish(tmp: Path, target: Path) -> None:
    fd = os.open(tmp.parent, os.O_RDONLY)
    try:
        os.rename(tmp, target)
        os.fsync(fd)
    except OSError:
        if not (target / "manifest.json").is_file():
            raise
    finally:
        os.close(fd)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
