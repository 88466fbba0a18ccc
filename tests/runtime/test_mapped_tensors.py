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


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k_m"])
def test_a_loaded_gguf_bundle_reads_its_weights_from_the_bundle_file(tmp_path, fmt):
    """No second copy: every weight of the loaded model is a mapping of the bundle's weights file,
    except q/k/v and gate/up, concatenated at load (their sources are unmapped once fused)."""
    from benchmarks.cpu_scale import Geometry, write_gguf
    from trtedge import LLM

    path = tmp_path / f"tiny-{fmt}.gguf"
    write_gguf(path, Geometry("tiny", "llama", 256, 512, 2, 4, 2, 600, False, False, 10000.0), fmt)
    with LLM(
        str(path), cache_dir=str(tmp_path / "cache"), engine_process=False, max_kv_cache_capacity=64
    ) as llm:
        (weights,) = llm.bundle.weight_files()
        model, file = llm.model, str(weights.resolve())
        mapped = {"embed": model.embed.data, "lm_head": model.lm_head.quantized.data}
        fused = {}
        for i, layer in enumerate(model.layers):
            mapped |= {f"{i}.o": layer.o.quantized.data, f"{i}.down": layer.mlp.down.quantized.data}
            fused |= {f"{i}.qkv": layer.qkv.quantized.data, f"{i}.gate_up": layer.mlp.gate_up.quantized.data}
        for name, tensor in mapped.items():
            assert _mapping_of(tensor.data_ptr()) == file, name
        for name, tensor in fused.items():
            assert _mapping_of(tensor.data_ptr()) != file, name
        fused_bytes = sum(t.nbytes for t in fused.values())
        assert sum(t.nbytes for t in mapped.values()) + fused_bytes <= weights.stat().st_size
        assert weights.stat().st_size < path.stat().st_size * 1.1  # the blocks kept, not widened
        maps = [line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines()]
        spans = [[int(x, 16) for x in f[0].split("-")] for f in maps if len(f) > 5 and f[5] == file]
        # the fused tensors' sources are no longer mapped (one page of slack per mapping)
        assert sum(hi - lo for lo, hi in spans) <= weights.stat().st_size - fused_bytes + 4096 * len(spans)
