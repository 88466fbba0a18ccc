"""Runtime bundles: build profile, content fingerprint, cache key, atomic publish, locks, LRU prune.

Layout of a cache directory::

    <cache_dir>/bundles/<key>/          published bundles (manifest.json is written last)
    <cache_dir>/bundles/.tmp-<key>-*    builds in progress (stale ones are removed on the next run)
    <cache_dir>/bundles/.trash-*        bundles being deleted
    <cache_dir>/locks/<key>.build       held exclusively while <key> is built
    <cache_dir>/locks/<key>.use         held shared by every process that has <key> loaded
    <cache_dir>/checkpoints/            downloads (never pruned or cleared unless asked)
    <cache_dir>/kernels/                compiled CPU kernels (never touched)

The last-used time of a bundle is the mtime of its manifest.json.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("trtedge")

LAYOUT_VERSION = 1
DEFAULT_MAX_SIZE_GB = 50.0
COMPONENTS = ("llm", "draft")
SPECULATIVE_METHODS = ("draft", "eagle", "mtp", "ngram")
_DRAFT_METHODS = ("draft", "eagle")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_WEIGHTS = ("auto", "float", "int8")

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
)


class BundleError(ValueError):
    """A bundle or cache operation failed; the message is one line."""


def check_max_size_gb(value, flag: str = "--engine-cache-max-size-gb") -> float:
    """A cache cap must be a positive, finite number of GiB."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise BundleError(f"{flag} must be a positive number of GiB, got {value!r}")
    return float(value)


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
    num_draft_tokens: int | None = None
    components: tuple[str, ...] = ("llm",)
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        for name in ("max_input_len", "max_kv_cache_capacity", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BundleError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise BundleError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.weights not in _WEIGHTS:
            raise BundleError(f"--weights must be one of {', '.join(_WEIGHTS)}, got {self.weights!r}")
        unknown = [c for c in self.components if c not in COMPONENTS]
        if unknown or not self.components:
            raise BundleError(
                f"--components must name some of {', '.join(COMPONENTS)} (or all), got {unknown}"
            )
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise BundleError(
                f"--speculative-config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.speculative_method!r}"
            )
        if "draft" in self.components and not self.draft_model:
            raise BundleError("--components draft needs a draft model in --speculative-config")

    @classmethod
    def create(cls, *, components: str | Iterable[str] = "llm", speculative: dict | str | None = None, **kw):
        """A profile from CLI-style values: components "all" or "llm,draft", speculative as JSON or dict."""
        spec = parse_speculative(speculative)
        draft = spec.get("draft_model")
        if isinstance(components, str):
            names = [c.strip() for c in components.split(",") if c.strip()]
        else:
            names = list(components)
        if names == ["all"]:
            names = ["llm", "draft"] if draft else ["llm"]
        return cls(
            speculative_method=spec.get("method"),
            draft_model=draft,
            num_draft_tokens=spec.get("num_draft_tokens"),
            components=tuple(dict.fromkeys(names)),
            **kw,
        )

    @classmethod
    def from_launch(cls, config) -> BuildProfile:
        """The profile of a LaunchConfig (the LLM component only)."""
        return cls(
            max_input_len=config.max_input_len,
            max_kv_cache_capacity=config.max_kv_cache_capacity,
            max_batch_size=config.max_batch_size,
            dtype=config.dtype,
            weights=config.weights,
        )

    def key_fields(self) -> dict:
        fields = asdict(self)
        fields.pop("draft_model")
        fields["components"] = list(self.components)
        return fields

    def summary(self) -> str:
        text = (
            f"in={self.max_input_len} kv={self.max_kv_cache_capacity} batch={self.max_batch_size} "
            f"dtype={self.dtype} weights={self.weights}"
        )
        if self.speculative_method:
            text += f" spec={self.speculative_method}"
        return text


def parse_speculative(value: dict | str | None) -> dict:
    """--speculative-config: {"method": "draft"|"eagle"|"mtp"|"ngram", "draft_model": ..., "num_draft_tokens": k}."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BundleError(f"--speculative-config is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise BundleError("--speculative-config must be a JSON object")
    unknown = sorted(set(value) - {"method", "draft_model", "num_draft_tokens"})
    if unknown:
        raise BundleError(f"--speculative-config: unknown key(s) {', '.join(unknown)}")
    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise BundleError(f"--speculative-config method must be one of {', '.join(SPECULATIVE_METHODS)}")
    if method in _DRAFT_METHODS and not value.get("draft_model"):
        raise BundleError(f"--speculative-config method {method} needs draft_model")
    k = value.get("num_draft_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise BundleError("--speculative-config num_draft_tokens must be a positive integer")
    return dict(value)


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
    for file in sorted(path.glob("*.safetensors")):
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


# ---- locks ---------------------------------------------------------------------------------------
class FileLock:
    """An fcntl.flock on a lock file; released when the process dies, so a kill -9 leaves no lock."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, *, shared: bool = False, blocking: bool = True) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


# ---- the cache directory ---------------------------------------------------------------------------
@dataclass
class CachedBundle:
    key: str
    path: Path
    model: str
    profile: dict
    size_bytes: int
    last_used: float
    created: str
    inodes: dict = field(default_factory=dict, repr=False)  # (dev, ino) -> size, to count hard links once

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "path": str(self.path),
            "model": self.model,
            "profile": self.profile,
            "size_bytes": self.size_bytes,
            "last_used": self.last_used,
            "created": self.created,
        }


def default_cache_dir() -> Path:
    from trtedge.runtime.checkpoint import default_cache_dir as default

    return default()


class Cache:
    def __init__(self, cache_dir: str | os.PathLike | None = None):
        self.root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.bundles = self.root / "bundles"
        self.locks = self.root / "locks"

    def bundle_dir(self, key: str) -> Path:
        return self.bundles / key

    def lock(self, key: str, kind: str) -> FileLock:
        return FileLock(self.locks / f"{key}.{kind}")

    def temp_dir(self, key: str) -> Path:
        return self.bundles / f".tmp-{key}-{os.getpid()}-{os.urandom(4).hex()}"

    def entries(self) -> list[CachedBundle]:
        if not self.bundles.is_dir():
            return []
        found = []
        for path in sorted(self.bundles.iterdir()):
            if path.name.startswith("."):
                continue
            manifest_file = path / "manifest.json"
            try:
                manifest = json.loads(manifest_file.read_text())
                last_used = manifest_file.stat().st_mtime
            except (OSError, ValueError):
                continue  # removed meanwhile, or not a bundle
            inodes = _inodes(path)
            found.append(
                CachedBundle(
                    key=path.name,
                    path=path,
                    model=manifest.get("model", "?"),
                    profile=manifest.get("profile", {}),
                    size_bytes=sum(inodes.values()),
                    last_used=last_used,
                    created=manifest.get("created", ""),
                    inodes=inodes,
                )
            )
        return found

    def remove(self, entry: CachedBundle) -> bool:
        """Delete a bundle unless a process has it loaded (or is building it); False when skipped."""
        lock = self.lock(entry.key, "use")
        if not lock.acquire(blocking=False):
            return False
        trash = self.bundles / f".trash-{entry.key}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.rename(entry.path, trash)
        except FileNotFoundError:
            return True
        finally:
            lock.release()
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def clean_stale(self) -> None:
        """Remove leftovers of killed builds and interrupted deletes."""
        if not self.bundles.is_dir():
            return
        for path in self.bundles.iterdir():
            if path.name.startswith(".trash-"):
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith(".tmp-"):
                lock = self.lock(path.name.split("-")[1], "build")
                if lock.acquire(blocking=False):
                    try:
                        shutil.rmtree(path, ignore_errors=True)
                    finally:
                        lock.release()

    def prune(self, max_bytes: float, keep: Iterable[str] = (), dry_run: bool = False) -> list[CachedBundle]:
        """Evict least-recently-used bundles until the bundles take at most max_bytes."""
        keep = set(keep)
        if not dry_run:
            self.clean_stale()
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        owners: dict = {}
        sizes: dict = {}
        for e in entries:
            for inode, size in e.inodes.items():
                owners.setdefault(inode, set()).add(e.key)
                sizes[inode] = size
        total = sum(sizes.values())
        removed = []
        for e in entries:
            if total <= max_bytes:
                break
            if e.key in keep:
                continue
            if dry_run:
                probe = self.lock(e.key, "use")
                free = probe.acquire(blocking=False)
                probe.release()
            else:
                free = self.remove(e)
            if not free:
                log.warning("bundle %s (%s) is in use by another process; not evicted", e.key, e.model)
                continue
            for inode in e.inodes:
                owners[inode].discard(e.key)
                if not owners[inode]:
                    total -= sizes[inode]
            removed.append(e)
        return removed

    def clear(self, checkpoints: bool = False) -> list[CachedBundle]:
        """Remove every bundle not in use (and, with checkpoints=True, the downloads)."""
        self.clean_stale()
        removed = []
        for e in self.entries():
            if self.remove(e):
                removed.append(e)
            else:
                log.warning("bundle %s (%s) is in use by another process; not removed", e.key, e.model)
        if checkpoints:
            shutil.rmtree(self.root / "checkpoints", ignore_errors=True)
        return removed


def _inodes(path: Path) -> dict:
    found = {}
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            found[(st.st_dev, st.st_ino)] = st.st_size
    return found


# ---- loaded bundles --------------------------------------------------------------------------------
class BundleComponent:
    """One model of a bundle (the LLM or the draft), loadable like a Checkpoint."""

    def __init__(self, path: Path, section: dict, name: str, checkpoint_path: Path | None = None):
        self.path = path
        self.section = section
        self.source = name
        self.config = section["config"]
        self.quantization = section.get("quantization") or {}
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

    def iter_tensors(self) -> Iterator[tuple[str, object]]:
        from safetensors import safe_open

        for file in self.weight_files():
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def load_tokenizer(self):
        from trtedge.runtime.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path)


class Bundle(BundleComponent):
    """A published bundle: ``key``, ``path``, ``manifest``; the LLM component's checkpoint interface;
    ``draft`` when built with one. Holds a shared lock until ``release()`` so that no prune removes it."""

    def __init__(self, path: Path, name: str | None = None, checkpoint_path: Path | None = None):
        self.manifest = json.loads((path / "manifest.json").read_text())
        comps = self.manifest["components"]
        super().__init__(path, comps["llm"], name or self.manifest["model"], checkpoint_path)
        self.key = path.name
        self.built = False
        self.draft = None
        if "draft" in comps:
            self.draft = BundleComponent(path / "draft", comps["draft"], comps["draft"]["model"])
        self._lock: FileLock | None = None

    def touch(self) -> None:
        os.utime(self.path / "manifest.json")

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def validate(self) -> None:
        """Cheap structural load: tokenizer, weight headers, the tensors every model needs."""
        from safetensors import safe_open

        self.load_tokenizer()
        for component in (self, self.draft):
            if component is None:
                continue
            names = set()
            for file in component.weight_files():
                with safe_open(str(file), framework="pt") as f:
                    names.update(f.keys())
            if "model.embed_tokens.weight" not in names:
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
    from trtedge.runtime.checkpoint import resolve_checkpoint
    from trtedge.runtime.embedded import EMBEDDED_MODEL_NAME, embedded_model_path

    if model is None or str(model) == "":
        return _Source(EMBEDDED_MODEL_NAME, embedded_model_path(), None)
    path = Path(str(model)).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _Source(str(model), path, None)
    checkpoint = resolve_checkpoint(model, cache.root)
    return _Source(checkpoint.name, checkpoint.path, checkpoint)


def _resolve(model, source: _Source, cache: Cache):
    from trtedge.runtime.checkpoint import resolve_checkpoint

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
    from trtedge.runtime import builder

    profile = profile or BuildProfile()
    max_bytes = check_max_size_gb(max_size_gb) * 2**30
    cache = Cache(cache_dir)
    if clear:
        cache.clear()
    source = _locate(model, cache)
    fp, files = fingerprint(source.path)
    draft_source = draft_fp = None
    if profile.draft_model:
        draft_source = _locate(profile.draft_model, cache)
        draft_fp = fingerprint(draft_source.path)[0]
    key = cache_key(fp, draft_fp, profile)
    target = cache.bundle_dir(key)
    use = cache.lock(key, "use")
    use.acquire(shared=True)  # waits while a prune is deleting this very bundle
    try:
        built = False
        if not (target / "manifest.json").is_file():
            build = cache.lock(key, "build")
            if not build.acquire(blocking=False):
                log.warning("another process is building bundle %s; waiting for it", key)
                build.acquire()
            try:
                if not (target / "manifest.json").is_file():
                    for stale in cache.bundles.glob(f".tmp-{key}-*"):
                        shutil.rmtree(stale, ignore_errors=True)
                    checkpoint = _resolve(model, source, cache)
                    draft = _resolve(profile.draft_model, draft_source, cache) if draft_source else None
                    tmp = cache.temp_dir(key)
                    try:
                        builder.build_bundle(
                            checkpoint,
                            profile,
                            tmp,
                            fingerprint=(fp, files),
                            draft=draft,
                            cache=cache,
                            progress=progress,
                        )
                        Bundle(tmp, source.name, source.path).validate()
                        _publish(tmp, target)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
                    built = True
            finally:
                build.release()
        bundle = Bundle(target, source.name, source.path)
        bundle.built = built
        bundle._lock = use
        bundle.touch()
    except BaseException:
        use.release()
        raise
    for e in cache.prune(max_bytes, keep={key}):
        log.info("evicted bundle %s (%s, %.1f MiB)", e.key, e.model, e.size_bytes / 2**20)
    return bundle


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


# ---- public helpers ---------------------------------------------------------------------------------
def clear_engine_cache(cache_dir: str | os.PathLike | None = None) -> list[CachedBundle]:
    """Remove all compiled bundles (not downloaded checkpoints, not bundles other processes use)."""
    return Cache(cache_dir).clear()


def prune_engine_cache(
    max_size_gb: float | None = None, cache_dir: str | os.PathLike | None = None
) -> list[CachedBundle]:
    """Evict least-recently-used bundles until they take at most max_size_gb GiB (default 50)."""
    cap = check_max_size_gb(DEFAULT_MAX_SIZE_GB if max_size_gb is None else max_size_gb, "max_size_gb")
    return Cache(cache_dir).prune(cap * 2**30)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
