"""GGUF blocks kept as the file holds them (Q8_0, Q4_K, Q5_K, Q6_K): the native kernels against
gguf's own numpy dequantization, and greedy decoding against the same file dequantized to float32
(Q4_0 too, whose blocks become int4 without requantization)."""

import gguf
import numpy as np
import pytest
import torch

from benchmarks.cpu_scale import Geometry, _quantized, write_gguf
from trtedge.runtime.artifacts.quantize import QuantizedTensor, gguf_blocks
from trtedge.runtime.ops import cpu_kernels
from trtedge.runtime.ops.linear import GgufLinear

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the native CPU kernels")
KINDS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _reference(blocks: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    data = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(data)).reshape(rows, cols).float()


@pytest.mark.parametrize("kind", KINDS)
def test_native_dequantization_and_product_match_gguf(kind):
    rows, cols = 12, 512
    blocks = _quantized(np.random.default_rng(3), kind, rows, cols)
    q = gguf_blocks(blocks, kind, rows, cols)
    ref = _reference(blocks, kind, rows, cols)
    assert q.shape == (rows, cols) and q.nbytes == blocks.nbytes + q.scale.nbytes
    torch.testing.assert_close(q.dequantize(), ref, rtol=1e-6, atol=1e-7)
    layer = GgufLinear(q, torch.randn(rows), lib)
    for m in (1, 5, 70):  # 70: past the kernel's rows, the dequantized product
        x = torch.randn(m, cols)
        expected = x @ ref.T + layer.bias
        # activations quantized to int16 per group of 32: relative error ~1e-4
        torch.testing.assert_close(layer(x), expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())


@pytest.mark.parametrize("cols", [32, 96, 576, 800])
def test_q8_0_product_at_widths_that_are_not_whole_activation_chunks(cols):
    # a Q8_0 row sums its blocks 8 at a time (one activation scale per 256 inputs): 576 (SmolLM2's
    # width) ends in a chunk of 2 blocks, 800 in one of 1 and an odd count, 32 and 96 in a single one
    rows = 9
    blocks = _quantized(np.random.default_rng(cols), "Q8_0", rows, cols)
    ref = _reference(blocks, "Q8_0", rows, cols)
    layer = GgufLinear(gguf_blocks(blocks, "Q8_0", rows, cols), None, lib)
    for m in (1, 3, 6):
        x = torch.randn(m, cols)
        expected = x @ ref.T
        torch.testing.assert_close(layer(x), expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())
        # and each row's value is the same bits in the batch as alone (the lm_head of every decode step)
        alone = torch.cat([layer(x[i : i + 1].contiguous()) for i in range(m)])
        assert torch.equal(layer(x), alone)


def test_rows_of_several_types_in_one_tensor():
    # a fused q/k/v of a Q4_K_M file: Q4_K rows, then Q6_K rows; rows picked across both
    a, b = (
        _quantized(np.random.default_rng(0), "Q4_K", 6, 256),
        _quantized(np.random.default_rng(1), "Q6_K", 3, 256),
    )
    fused = QuantizedTensor.cat([gguf_blocks(a, "Q4_K", 6, 256), gguf_blocks(b, "Q6_K", 3, 256)])
    ref = torch.cat([_reference(a, "Q4_K", 6, 256), _reference(b, "Q6_K", 3, 256)])
    assert fused.shape == (9, 256) and fused.scale.shape[0] == 2
    torch.testing.assert_close(fused.dequantize(), ref, rtol=1e-6, atol=1e-7)
    index = torch.tensor([8, 0, 7, 2])
    torch.testing.assert_close(fused.select_rows(index).dequantize(), ref[index], rtol=1e-6, atol=1e-7)
    x = torch.randn(3, 256)
    torch.testing.assert_close(GgufLinear(fused, None, lib)(x), x @ ref.T, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(fused.rows(torch.tensor([[1, 8]])), ref[[1, 8]][None])


@pytest.mark.parametrize("kind", KINDS)
def test_an_embedding_lookup_reads_the_rows_it_names(kind):
    # up to 8 ids: each row dequantized in place from the tensor's bytes; more: gathered first
    rows, cols = 40, 512
    blocks = _quantized(np.random.default_rng(5), kind, rows, cols)
    q, ref = gguf_blocks(blocks, kind, rows, cols), _reference(blocks, kind, rows, cols)
    for ids in ([39], [0, 39, 7, 7], list(range(2, 14))):
        index = torch.tensor(ids)
        torch.testing.assert_close(q.rows(index), ref[index], rtol=1e-6, atol=1e-7)
    with pytest.raises(IndexError, match="40"):
        q.rows(torch.tensor([40]))


TINY_LLAMA = Geometry("tiny", "llama", 256, 512, 2, 4, 2, 1000, False, False, 10000.0)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k_m", "q5_k", "q6_k"])
def test_greedy_from_kept_blocks_equals_the_file_dequantized_to_float32(tmp_path, fmt):
    from trtedge import LLM, SamplingParams

    path = tmp_path / f"tiny-{fmt}.gguf"
    write_gguf(path, TINY_LLAMA, fmt)  # llama: q/k rows permuted in the file
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for weights in ("auto", "fp32"):
        with LLM(
            str(path), cache_dir=str(tmp_path / "cache"), weights=weights, max_kv_cache_capacity=256
        ) as llm:
            if weights == "auto":
                assert llm.describe()["weight_bytes"] < path.stat().st_size  # blocks, not floats
            outs[weights] = llm.generate([[5, 6, 7, 8], list(range(40, 110))], params)
    for kept, ref in zip(outs["auto"], outs["fp32"]):
        assert kept.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_prefill_product_dequantizes_its_weight_in_tiles(monkeypatch):
    """Past the kernels' rows the weight is dequantized a tile of rows at a time (an 8B gate_up is
    0.44 GiB of floats): the same product as the whole layer dequantized, for every format."""
    from trtedge.runtime.ops import linear
    from trtedge.runtime.ops.linear import make_linear

    a, b = (
        _quantized(np.random.default_rng(0), "Q4_K", 7, 256),
        _quantized(np.random.default_rng(1), "Q6_K", 6, 256),
    )
    mixed = QuantizedTensor.cat([gguf_blocks(a, "Q4_K", 7, 256), gguf_blocks(b, "Q6_K", 6, 256)])
    weight, bias, x = torch.randn(13, 256) * 0.1, torch.randn(13), torch.randn(300, 256)
    layers = [
        GgufLinear(mixed, bias, lib),
        make_linear(weight, bias, "int4"),
        make_linear(weight, bias, "int8"),
    ]
    whole = [layer(x) for layer in layers]  # 300 rows: past every kernel's, one dequantized layer
    monkeypatch.setattr(linear, "DEQUANTIZED_TILE_BYTES", 4 * 256 * 4)  # 4 rows: the Q4_K / Q6_K runs split
    tiles = []
    plain, native = QuantizedTensor.dequantize, cpu_kernels.int4_dequantize
    monkeypatch.setattr(QuantizedTensor, "dequantize", lambda q, *a: tiles.append(q.shape[0]) or plain(q, *a))
    monkeypatch.setattr(
        cpu_kernels, "int4_dequantize", lambda lib, q: tiles.append(q.shape[0]) or native(lib, q)
    )
    for layer, expected in zip(layers, whole):
        tiles.clear()
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        assert tiles == [4, 4, 4, 1], type(layer).__name__
