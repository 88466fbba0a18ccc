"""A safetensors file's tensors as copy-on-write memory maps of the file (no second copy in RAM).

``safe_open(...).get_tensor`` reads each tensor into new memory while the whole file is mapped, so
loading a bundle holds its weights twice until the file is closed (an 8B int4 model: ~10 GB for a
~5 GB bundle). Here each tensor is its own private mapping of its bytes: nothing is read until used,
the pages are the page cache's (file-backed, given back under memory pressure and shared by every
process that loads the same bundle), and a tensor the model only reads once (q/k/v and gate/up,
concatenated at load) is unmapped when it is dropped. Writing to a tensor copies only the pages
written (MAP_PRIVATE), so the file never changes.
"""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path

import numpy as np
import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def mapped_tensors(file: str | Path, skip: Container[str] = ()) -> dict[str, torch.Tensor]:
    """name -> tensor over a private mapping of ``file`` (a safetensors file), in file order."""
    file = Path(file)
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    start = 8 + size
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__" or name in skip:
            continue
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if end == begin:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        raw = np.memmap(file, dtype=np.uint8, mode="c", offset=start + begin, shape=(end - begin,))
        tensor = torch.from_numpy(raw)
        if (start + begin) % dtype.itemsize:  # an unaligned tensor (not written by trtedge): copied
            tensor = tensor.clone()
        out[name] = tensor.view(dtype).reshape(info["shape"])
    return out
