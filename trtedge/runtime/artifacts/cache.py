"""The bundle cache directory: layout, locks, last-used times, LRU prune, clear.

Layout of a cache directory::

    <cache_dir>/bundles/<key>/          published bundles (manifest.json is written last)
    <cache_dir>/bundles/.tmp-<key>-*    builds in progress (stale ones are removed on the next run)
    <cache_dir>/bundles/.trash-*        bundles being deleted
    <cache_dir>/locks/<key>.build       held exclusively while <key> is built
    <cache_dir>/locks/<key>.use         held shared by every process that has <key> loaded
    <cache_dir>/checkpoints/            downloads (never pruned or cleared unless asked)
    <cache_dir>/kernels/                compiled CPU kernels (never touched)

The last-used time of a bundle is the mtime of its manifest.json. A bundle's manifest records the
layout version it was written in (part of the cache key, so a newer trtedge never opens an older
bundle); bundles of an older layout are ignored, and ``prune`` removes them first, whatever the cap.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("trtedge")

DEFAULT_MAX_SIZE_GB = 50.0
# Bump when a bundle's files or manifest change meaning. 3: int4 packed in blocks of 16 groups;
# 4: a GGUF's Q8_0 / Q4_K / Q5_K / Q6_K weights kept as "gguf" block tensors under --weights auto
# (a layout-3 bundle of the same file holds them requantized to int4 / int8).
LAYOUT_VERSION = 4


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

    def __del__(self) -> None:
        self.release()


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
    layout_version: int = 0  # 0: written before manifests recorded it
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
            "layout_version": self.layout_version,
            "outdated": self.outdated,
        }

    @property
    def outdated(self) -> bool:
        """Written by an older trtedge in a layout this one does not read; prune removes it."""
        return self.layout_version < LAYOUT_VERSION


def default_cache_dir() -> Path:
    from trtedge.runtime.artifacts.checkpoint import default_cache_dir as default

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
            if not isinstance(manifest, dict):
                continue
            layout = manifest.get("layout_version", 0)
            inodes = _inodes(path)
            found.append(
                CachedBundle(
                    key=path.name,
                    path=path,
                    model=str(manifest.get("model", "?")),
                    profile=manifest.get("profile") if isinstance(manifest.get("profile"), dict) else {},
                    size_bytes=sum(inodes.values()),
                    last_used=last_used,
                    created=str(manifest.get("created", "")),
                    layout_version=layout if isinstance(layout, int) and not isinstance(layout, bool) else 0,
                    inodes=inodes,
                )
            )
        return found

    def in_use(self, key: str) -> bool:
        """True while some process (this one included) has the bundle loaded or is building it."""
        probe = self.lock(key, "use")
        try:
            free = probe.acquire(blocking=False)
        except OSError:
            return False
        probe.release()
        return not free

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
        """Remove the bundles of an older layout, then evict least-recently-used bundles until the
        bundles take at most max_bytes."""
        keep = set(keep)
        if not dry_run:
            self.clean_stale()
        # Older layouts first: sorting puts them ahead of every current bundle, and they go at any size.
        entries = sorted(self.entries(), key=lambda e: (not e.outdated, e.last_used))
        owners: dict = {}
        sizes: dict = {}
        for e in entries:
            for inode, size in e.inodes.items():
                owners.setdefault(inode, set()).add(e.key)
                sizes[inode] = size
        total = sum(sizes.values())
        removed = []
        for e in entries:
            if total <= max_bytes and not e.outdated:
                break
            if e.key in keep:
                continue
            free = not self.in_use(e.key) if dry_run else self.remove(e)
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
