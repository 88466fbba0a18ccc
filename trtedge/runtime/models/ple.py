"""Per-layer embeddings (PLE, Gemma 3n and Gemma 4): a table of ``vocab_size_per_layer_input`` rows of
``num_layers x hidden_size_per_layer_input`` values that each token gathers its row of.

The table is often larger than the rest of the model. ``resident`` keeps it whole on the device;
``cached`` keeps it on the host (memory-mapped from the safetensors file holding it) and a pool of
``cache_slots`` rows on the device, filled per step through a fixed 64 MiB host staging buffer. Slot 0
is padding (zeros, never handed out), so a step may need at most ``cache_slots - 1`` distinct rows: a
step needing more is run in consecutive pieces of tokens (``plan_pieces``), each within the pool; only
a piece that cannot be cut (a token tree verified under an explicit mask) is refused.
These settings change where rows live, never the weights: the bundle and its key stay the same.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from trtedge.runtime.ops.attention import AttentionBatch

log = logging.getLogger("trtedge")

RESIDENCIES = ("resident", "cached")
STAGING_BUDGET_BYTES = 64 * 2**20
PLE_TENSOR = "model.embed_tokens_per_layer.weight"


class PleConfigError(ValueError):
    """A PLE setting is invalid; the message names the flag."""


class PleCapacityError(ValueError):
    """A step needs more distinct PLE rows than the pool holds and cannot be split."""


@dataclass(frozen=True)
class PleRuntimeConfig:
    """Where the per-layer embedding table lives (``--ple-residency``, ``--ple-cache-slots``,
    ``--ple-file``; ``LLM(ple_config=...)``). ``cached`` needs ``cache_slots`` >= 2 (slot 0 is padding).
    ``file_path``: a safetensors file holding the table, read instead of the checkpoint's copy."""

    residency: str = "resident"
    cache_slots: int | None = None
    file_path: str | None = None

    def __post_init__(self) -> None:
        if self.residency not in RESIDENCIES:
            raise PleConfigError(
                f"ple_config.residency (--ple-residency) must be one of {', '.join(RESIDENCIES)}, "
                f"got {self.residency!r}"
            )
        slots = self.cache_slots
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 2):
            raise PleConfigError(
                f"ple_config.cache_slots (--ple-cache-slots) must be an integer >= 2 (slot 0 is padding), "
                f"got {slots!r}"
            )
        if self.residency == "cached" and slots is None:
            raise PleConfigError("--ple-residency cached needs --ple-cache-slots N (ple_config.cache_slots)")
        if self.residency == "resident" and slots is not None:
            raise PleConfigError("--ple-cache-slots needs --ple-residency cached (ple_config.residency)")
        if self.file_path is not None and not Path(self.file_path).expanduser().is_file():
            raise PleConfigError(f"ple_config.file_path (--ple-file): no such file {self.file_path!r}")

    @classmethod
    def coerce(cls, value) -> PleRuntimeConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise PleConfigError(
                    f"ple_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
            return cls(**value)
        raise PleConfigError(f"ple_config must be a PleRuntimeConfig or a mapping, got {value!r}")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def map_ple_file(path: str) -> torch.Tensor:
    """The PLE table of a safetensors file, memory-mapped (pages are read as rows are used): the file's
    only tensor, or the one named ``*embed_tokens_per_layer.weight``."""
    file = Path(path).expanduser()
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        names = [n for n in header if n.endswith("embed_tokens_per_layer.weight")] or list(header)
        if len(names) != 1:
            raise PleConfigError(f"--ple-file {path}: expected one PLE tensor, found {sorted(header)}")
        entry = header[names[0]]
        if entry["dtype"] not in _SAFETENSORS_DTYPES or len(entry["shape"]) != 2:
            raise PleConfigError(f"--ple-file {path}: {names[0]} must be a 2-D F32/F16/BF16 tensor")
        begin, end = entry["data_offsets"]
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable, never written
        if hasattr(mmap, "MADV_RANDOM"):  # rows are read at random: no read-ahead around each one
            mapped.madvise(mmap.MADV_RANDOM)
    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    flat = torch.frombuffer(
        mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=8 + size + begin
    )
    return flat.view(entry["shape"])


def find_ple_tensor(files) -> tuple[Path, str] | None:
    """The safetensors file among ``files`` holding a PLE table, and the table's name there."""
    for file in files:
        with Path(file).open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name in header:
            if name.endswith("embed_tokens_per_layer.weight"):
                return Path(file), name
    return None


class PerLayerEmbeddings:
    """Token ids -> their PLE rows (scaled by sqrt(per-layer dim)), from the table or the pool."""

    def __init__(
        self,
        table: torch.Tensor,
        config: PleRuntimeConfig,
        device: torch.device,
        dtype: torch.dtype,
        scale: float,
        source: str = "the checkpoint",
        mapped: bool = False,
    ):
        """``mapped``: ``table`` is a file mapping (``map_ple_file``); resident, it is read in whole."""
        self.config = config
        self.vocab_size, self.width = table.shape
        self.device, self.dtype = device, dtype
        self.scale = torch.tensor(scale, dtype=dtype, device=device)  # HF rounds it to the weights' dtype
        self.hits = self.misses = self.evictions = self.bytes_loaded = self.split_steps = 0
        row_bytes = self.width * torch.empty((), dtype=dtype).element_size()
        if config.residency == "resident":
            self.table = table.to(device=device, dtype=dtype, copy=mapped)
            self.capacity = None
            self.pool_bytes = self.table.numel() * self.table.element_size()
            self.staging = None
            log.info(
                "per-layer embeddings: resident, %d rows x %d (%.1f MiB) on %s",
                self.vocab_size, self.width, self.pool_bytes / 2**20, device.type,
            )  # fmt: skip
            return
        self.host = table  # as stored; rows are cast as they are copied
        slots = config.cache_slots
        self.capacity = slots - 1
        self.pool = torch.zeros(slots, self.width, dtype=dtype, device=device)
        self.pool_bytes = slots * row_bytes
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # token id -> slot, least recently used first
        self._free = list(range(slots - 1, 0, -1))
        rows = max(1, min(self.capacity, STAGING_BUDGET_BYTES // row_bytes))
        self.staging = torch.empty(rows, self.width, dtype=dtype, pin_memory=device.type == "cuda")
        log.info(
            "per-layer embeddings: cached, %d slots x %d (%.1f MiB) on %s; table of %d rows (%.1f MiB) on "
            "the host from %s; host staging %.1f MiB of the %d MiB budget",
            slots, self.width, self.pool_bytes / 2**20, device.type, self.vocab_size,
            self.vocab_size * row_bytes / 2**20, source, self.staging_bytes / 2**20,
            STAGING_BUDGET_BYTES // 2**20,
        )  # fmt: skip

    @property
    def staging_bytes(self) -> int:
        return 0 if self.staging is None else self.staging.numel() * self.staging.element_size()

    def valid_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids past the table read row 0, as transformers does."""
        return torch.where((ids >= 0) & (ids < self.vocab_size), ids, 0)

    def rows(self, ids: torch.Tensor, host_ids: list[int] | None = None) -> torch.Tensor:
        """[T, width] rows of ``ids`` (valid ids); cached: ``host_ids`` are the same ids on the host and
        must need at most ``capacity`` distinct rows."""
        if self.capacity is None:
            return torch.nn.functional.embedding(ids, self.table) * self.scale
        slots = self._load(host_ids if host_ids is not None else ids.tolist())
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        return self.pool.index_select(0, index) * self.scale

    def _load(self, ids: list[int]) -> list[int]:
        distinct = list(dict.fromkeys(ids))
        if len(distinct) > self.capacity:
            raise PleCapacityError(capacity_message(len(distinct), self.capacity))
        missing = []
        for token in distinct:
            if token in self._slot_of:
                self._slot_of.move_to_end(token)
            else:
                missing.append(token)
        self.hits += len(distinct) - len(missing)
        self.misses += len(missing)
        for token in missing:  # the rows this step needs are the most recent: eviction skips them
            if not self._free:
                _, slot = self._slot_of.popitem(last=False)
                self._free.append(slot)
                self.evictions += 1
            self._slot_of[token] = self._free.pop()
        rows = self.staging.shape[0]
        for i in range(0, len(missing), rows):
            part = missing[i : i + rows]
            staged = self.staging[: len(part)]
            staged.copy_(self.host[torch.tensor(part)])
            slots = torch.tensor([self._slot_of[t] for t in part]).to(self.device, non_blocking=True)
            self.pool.index_copy_(0, slots, staged.to(self.device, non_blocking=True))
            if self.device.type == "cuda":  # the staging rows are overwritten by the next part
                torch.cuda.current_stream().synchronize()
        self.bytes_loaded += len(missing) * self.width * self.pool.element_size()
        return [self._slot_of[t] for t in ids]

    def stats(self) -> dict:
        """Pool counters for /health and /metrics: distinct rows per step found (hits) or copied in
        (misses), evictions, bytes copied, steps split to fit, and the bytes held."""
        return {
            "residency": self.config.residency,
            "slots": None if self.capacity is None else self.capacity + 1,
            "rows_resident": self.vocab_size if self.capacity is None else len(self._slot_of),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_loaded": self.bytes_loaded,
            "split_steps": self.split_steps,
            "device_bytes": self.pool_bytes,
            "staging_bytes": self.staging_bytes,
        }


def capacity_message(needed: int, capacity: int) -> str:
    return (
        f"a step needs {needed} distinct per-layer embedding rows but the PLE pool holds {capacity} "
        f"(--ple-cache-slots {capacity + 1}, slot 0 is padding); raise --ple-cache-slots or use "
        "--ple-residency resident"
    )


def plan_pieces(ids: list[int], capacity: int | None) -> list[tuple[int, int]]:
    """Consecutive token ranges [start, end) of a step, each needing at most ``capacity`` distinct rows."""
    if capacity is None:
        return [(0, len(ids))]
    pieces, seen, start = [], set(), 0
    for i, token in enumerate(ids):
        if token not in seen and len(seen) == capacity:
            pieces.append((start, i))
            seen, start = set(), i
        seen.add(token)
    pieces.append((start, len(ids)))
    return pieces


def split_batch(batch: AttentionBatch, start: int, end: int) -> AttentionBatch:
    """The attention batch of tokens [start, end) of ``batch``: each sequence's share of them, whose
    keys end where that share ends (earlier pieces of it are in the cache by then)."""
    query_lens, context_lens, tables, masks = [], [], [], []
    offset = 0
    for i, (qlen, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
        a, b = max(start, offset), min(end, offset + qlen)
        if a < b:
            mask = batch.masks[i] if batch.masks else None
            if mask is not None and (a, b) != (offset, offset + qlen):
                raise PleCapacityError(
                    "a token tree verified under one mask cannot be split to fit the PLE pool; "
                    "raise --ple-cache-slots or use --ple-residency resident"
                )
            query_lens.append(b - a)
            context_lens.append(ctx - (offset + qlen - b))
            tables.append(batch.block_tables[i])
            masks.append(mask)
        offset += qlen
    return AttentionBatch(
        slot_mapping=batch.slot_mapping[start:end],
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        block_size=batch.block_size,
        masks=masks if batch.masks else None,
    )
