"""A bundle's safetensors files load as private memory maps: the same tensors as safetensors reads,
backed by the file itself (no second copy in RAM), and writes never reach the file."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtedge.runtime.artifacts.mapped import mapped_tensors


def _mapping_of(ptr: int) -> str | None:
    """The file backing the mapping that holds address ``ptr`` in this process, if any."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else None
    return None


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(64, 96, generator=g),
        "a.weight.int4": torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=g),
        "a.weight.int4_scale": torch.randn(64, 3, generator=g).half(),
        "b.bias": torch.randn(7, generator=g).bfloat16(),
        "c.weight.int8": torch.randint(-127, 128, (5, 33), dtype=torch.int8, generator=g),
        "d.fp8": torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn),
        "e.ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_mapped_tensors_equal_what_safetensors_reads(stored):
    expected = load_file(str(stored))
    got = mapped_tensors(stored)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert "a.weight" not in mapped_tensors(stored, skip={"a.weight"})


def test_mapped_tensors_are_backed_by_the_file_and_copy_on_write(stored):
    before = stored.read_bytes()
    got = mapped_tensors(stored)
    weight = got["a.weight"]
    assert _mapping_of(weight.data_ptr()) == str(stored.resolve())
    weight.mul_(0)  # the process's own pages now; the file is unchanged
    assert stored.read_bytes() == before
    assert torch.equal(mapped_tensors(stored)["a.weight"], load_file(str(stored))["a.weight"])
    assert not torch.equal(weight, mapped_tensors(stored)["a.weight"])


def test_an_unknown_dtype_is_named(tmp_path):
    import json
    import struct

    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError, match="'x' has unsupported dtype C64"):
        mapped_tensors(path)
