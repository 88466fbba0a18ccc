"""Quantized weights: int8 / int4 layers against their dequantized reference, GGUF Q4 blocks carried
over without loss, and `--weights int4` bundles of a float checkpoint."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.artifacts.bundle import BuildProfile, cache_key, fingerprint, prepare_bundle
from trtedge.runtime.artifacts.quantize import (
    GROUP,
    QuantizedTensor,
    int4_from_gguf_blocks,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from trtedge.runtime.models import load_model
from trtedge.runtime.ops import cpu_kernels
from trtedge.runtime.ops.linear import Int4Linear, Int8Linear, make_linear


@pytest.mark.parametrize("cols", [32, 96, 576])
def test_int4_quantize_error_is_within_half_a_step(cols):
    torch.manual_seed(0)
    w = torch.randn(40, cols) * 0.05 + 0.01
    q = quantize_int4(w)
    assert q.data.dtype == torch.uint8 and q.data.shape == (40, cols // 2)
    step = q.scale.float().repeat_interleave(GROUP, dim=1)
    err = (q.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-3 * w.abs().max()).all()
    assert err.mean() < 0.3 * step.mean()  # a real quantizer, not a constant
    values = torch.randint(0, 16, (5, cols), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


def test_int4_rejects_input_dims_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 48))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_map_to_int4_without_loss(kind):
    rng = np.random.default_rng(0)
    rows, cols = 6, 96
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, cols // 32, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, cols // 32, 2)) * 0.01).astype(np.float16)
    raw[..., 0:4] = scales.view(np.uint8).reshape(rows, cols // 32, 4)  # finite d (and m)
    raw = raw.reshape(rows, -1)
    reference = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    mapped = int4_from_gguf_blocks(raw, kind, rows, cols)
    np.testing.assert_array_equal(mapped.dequantize().numpy(), reference.astype(np.float32))


@pytest.mark.parametrize("rows", [1, 3, 5, 40])
@pytest.mark.parametrize("shape", [(64, 64), (130, 576), (8, 96), (5, 608), (6, 1024)])
def test_quantized_linears_match_dequantized_product(rows, shape):
    torch.manual_seed(1)
    n, k = shape
    weight, bias, x = torch.randn(n, k) * 0.1, torch.randn(n), torch.randn(rows, k)
    for layer in (make_linear(weight, bias, "int4"), make_linear(weight, bias, "int8")):
        # the native dequantize (prefill) reads the packing as the torch reference does
        torch.testing.assert_close(layer.dequantized(), layer.quantized.dequantize(), rtol=0, atol=0)
        ref = F.linear(x, layer.dequantized(), bias)
        out = layer(x)
        # the int4 kernel quantizes activations to int16 per block of 32: close to exact
        tol = 1e-3 * ref.abs().max().item() if isinstance(layer, Int4Linear) else 1e-4
        torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    assert isinstance(make_linear(quantize_int8(weight), None), Int8Linear)


@pytest.mark.parametrize("shape", [(130, 576), (9, 96), (5, 608), (12, 2048), (17, 1536)])
def test_an_int4_row_is_the_same_alone_and_in_a_batch(shape):
    # the kernel sums up to 4 activation rows per pass (1..4 compiled apart), and a prefill's many rows
    # run the integer GEMM where there is one: a row's value must be the same bits in every batch, or a
    # request's tokens and logprobs depend on what else the engine runs
    torch.manual_seed(2)
    n, k = shape
    layer = make_linear(torch.randn(n, k) * 0.1, torch.randn(n), "int4")
    x = torch.randn(257, k)
    alone = torch.cat([layer(x[i : i + 1].contiguous()) for i in range(257)])
    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no native kernels (no C compiler): every batch is dequantized")
    native_rows = lib.int4_kernel_max_rows(n, k)  # more: dequantized for the BLAS
    assert native_rows >= 64
    for rows in (2, 3, 4, 5, 8, 48, 65, 130, 257):
        if rows <= native_rows:
            assert torch.equal(layer(x[:rows].contiguous()), alone[:rows]), rows


@pytest.mark.parametrize(
    "rows, shape",
    [
        (65, (33, 1024)),
        (130, (7, 2048)),
        (97, (65, 512)),
        (300, (21, 1536)),
        (211, (3, 608)),
        (128, (19, 576)),
    ],
)
def test_int4_products_of_many_rows_match_the_dequantized_product(rows, shape):
    # prefill row counts: the integer GEMM (AVX2, K a multiple of 512) at odd N and row counts that
    # leave partial tiles; other K (odd group counts, a tail past the whole blocks) dequantize
    torch.manual_seed(3)
    n, k = shape
    layer = make_linear(torch.randn(n, k) * 0.1, torch.randn(n), "int4")
    x = torch.randn(rows, k)
    ref = F.linear(x.double(), layer.dequantized().double(), layer.bias.double()).float()
    # activations quantized to int16 per group of 32: close to exact
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-3 * ref.abs().max().item())


def _instruction_sets() -> list[str]:
    """-march levels whose int4 code paths this CPU runs: its own and, on a CPU with AVX-512 VNNI (whose
    kernels are compiled for it), AVX2 (x86-64-v3), so that the AVX2 GEMM runs there too."""
    flags = cpu_kernels.cpu_flags()
    levels = ["native"]
    if "avx512_vnni" in flags and all(f in flags for f in ("avx2", "fma", "f16c")):
        levels.append("x86-64-v3")
    return levels


@pytest.fixture(scope="module", params=_instruction_sets())
def kernels_for(request, tmp_path_factory):
    try:  # a directory of the test's own: never the user's kernel cache
        return cpu_kernels.compile_kernels(tmp_path_factory.mktemp("kernels"), request.param)
    except Exception as e:  # no C compiler, or one that does not know the level
        pytest.skip(f"the kernels could not be compiled for -march={request.param}: {e}")


@pytest.mark.parametrize("shape", [(19, 1024), (40, 2048), (7, 1536)])
def test_int4_gemm_rows_are_the_decode_kernels_bits_on_each_instruction_set(kernels_for, shape):
    # the AVX2 and the AVX-512 VNNI GEMMs each mirror their own decode kernel's float operations: a
    # prefill row must be the same bits as that row decoded alone, whichever the CPU compiles
    torch.manual_seed(4)
    n, k = shape
    layer = Int4Linear(quantize_int4(torch.randn(n, k) * 0.1), torch.randn(n), kernels_for)
    # K a multiple of 512: the GEMM takes any number of rows with AVX2 and on Zen cores with AVX-512 (on
    # other AVX-512 CPUs the BLAS takes past 64 rows, and the rows up to there are the decode kernel's)
    native_rows = kernels_for.int4_kernel_max_rows(n, k)
    assert native_rows >= 64 and (native_rows >= 257 or "avx512_vnni" in cpu_kernels.cpu_flags())
    x = torch.randn(257, k)
    alone = torch.cat([layer(x[i : i + 1].contiguous()) for i in range(257)])
    # the GEMM's first rows on Zen 4; whole and partial chunks and block-kernel row groups
    for rows in (12, 29, 48, 61, 66, 130, 257):
        if rows <= native_rows:
            assert torch.equal(layer(x[:rows].contiguous()), alone[:rows]), rows
    ref = F.linear(x.double(), layer.quantized.dequantize().double(), layer.bias.double()).float()
    torch.testing.assert_close(alone, ref, rtol=0, atol=1e-3 * ref.abs().max().item())


def test_prefill_tiles_multiply_in_bf16_when_asked(monkeypatch):
    # past the kernel's rows a quantized layer is dequantized for the dense product; with bf16 tiles (for
    # AMX CPUs; forced here: every CPU runs torch's bf16 product) its operands are bfloat16
    from trtedge.runtime.ops import linear

    torch.manual_seed(5)
    weight, bias, x = torch.randn(70, 96) * 0.1, torch.randn(70), torch.randn(300, 96)
    layer = make_linear(weight, bias, "int4")  # K = 96: past 64 rows, dequantized
    w = layer.quantized.dequantize()
    ref = F.linear(x.double(), w.double(), bias.double()).float()
    monkeypatch.setattr(linear, "_bf16_tiles", False)
    exact = layer(x)
    monkeypatch.setattr(linear, "_bf16_tiles", True)
    tiles = layer(x)
    expected = F.linear(x.bfloat16(), w.bfloat16()).float() + bias
    torch.testing.assert_close(tiles, expected, rtol=1e-5, atol=1e-5)  # bf16 operands, float32 sums and bias
    assert not torch.equal(tiles, exact)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tiles, ref, rtol=0, atol=1e-2 * ref.abs().max().item())
    few = layer(x[:5].contiguous())  # decode rows: the kernel's product, bf16 tiles or not
    monkeypatch.setattr(linear, "_bf16_tiles", False)
    assert torch.equal(few, layer(x[:5].contiguous()))
    amx = "amx_bf16" in cpu_kernels.cpu_flags()
    for setting, on in ((None, False), ("0", False), ("1", True), ("auto", amx)):  # opt-in, or where AMX is
        if setting is None:
            monkeypatch.delenv("TRTEDGE_CPU_BF16_TILES", raising=False)
        else:
            monkeypatch.setenv("TRTEDGE_CPU_BF16_TILES", setting)
        monkeypatch.setattr(linear, "_bf16_tiles", None)
        assert linear.bf16_tiles() is on, setting


def test_int4_profile_has_its_own_cache_key(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    fp = fingerprint(path)[0]
    keys = {w: cache_key(fp, None, BuildProfile(weights=w)) for w in ("bf16", "int4", "int8", "fp32")}
    assert len(set(keys.values())) == 4


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the native CPU kernels")
def test_weights_int4_quantizes_a_float_checkpoint(tmp_path):
    from safetensors import safe_open

    path = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    bundle = prepare_bundle(str(path), BuildProfile(weights="int4"), cache_dir=tmp_path / "cache")
    try:
        section = bundle.manifest["components"]["llm"]["weights"]
        assert not section["externalized"]
        quant = section["quantization"]
        assert quant["mode"] == "int4" and quant["int4"]["group_size"] == 32
        assert quant["int4"]["symmetric"] is False
        with safe_open(str(bundle.path / section["files"][0]), framework="pt") as f:
            names = set(f.keys())
        assert "model.layers.0.mlp.down_proj.weight.int4" in names
        assert "model.layers.0.mlp.down_proj.weight" not in names
        assert "model.embed_tokens.weight.int8" in names  # embeddings keep 8 bits
        model = load_model(bundle, dtype="float32", device="cpu", weights="int4", max_positions=64)
        assert isinstance(model.layers[0].mlp.gate_up, Int4Linear)
        assert model.layers[1].qkv.nbytes < 64 * 128  # packed: under a byte per weight
    finally:
        bundle.release()


def test_fp8_rows_round_to_e4m3_within_its_relative_step():
    from trtedge.runtime.artifacts.quantize import quantize_fp8

    torch.manual_seed(0)
    w = torch.randn(24, 80) * 0.05
    q = quantize_fp8(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (24, 1)
    assert q.data.float().abs().amax(dim=1).eq(448).all()  # each row's largest weight maps to 448
    scale = q.scale.expand_as(w)
    # E4M3 keeps 3 mantissa bits: half a step is 1/16 of the magnitude (subnormals: 2^-10 of the scale)
    assert ((q.dequantize() - w).abs() <= w.abs() / 16 + scale * 2**-10).all()
    blocks = QuantizedTensor("fp8", q.data, q.scale.repeat(1, 5) * torch.arange(1, 6))
    torch.testing.assert_close(blocks.dequantize(), q.dequantize() * torch.arange(1, 6).repeat_interleave(16))


def test_the_gpu_int4_layout_holds_the_bundles_weights():
    from trtedge.runtime.ops import triton_quant

    torch.manual_seed(0)
    q = quantize_int4(torch.randn(10, 192))
    gpu = triton_quant.int4_gpu_layout(q)
    assert gpu.data.shape == q.data.shape
    torch.testing.assert_close(triton_quant.int4_gpu_dequantize(gpu), q.dequantize(), rtol=0, atol=0)
    # byte j of a 64-input span: input j low, input 32 + j high
    codes = unpack_int4(q.data)
    assert int(gpu.data[3, 32 + 5]) == int(codes[3, 64 + 5]) | int(codes[3, 96 + 5]) << 4
    x = torch.randn(2, 192)
    torch.testing.assert_close(triton_quant.int4_reference(x, gpu, None), F.linear(x, q.dequantize()))
    with pytest.raises(ValueError, match="multiple of 64"):
        triton_quant.int4_gpu_layout(quantize_int4(torch.randn(4, 96)))


def test_fp8_profile_has_its_own_cache_key_and_quantizes_every_matrix(tmp_path):
    from safetensors import safe_open

    path = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    fp = fingerprint(path)[0]
    assert cache_key(fp, None, BuildProfile(weights="fp8")) != cache_key(
        fp, None, BuildProfile(weights="int8")
    )
    bundle = prepare_bundle(str(path), BuildProfile(weights="fp8"), cache_dir=tmp_path / "cache")
    try:
        section = bundle.manifest["components"]["llm"]["weights"]
        assert section["quantization"]["mode"] == "fp8"
        with safe_open(str(bundle.path / section["files"][0]), framework="pt") as f:
            names = set(f.keys())
            assert f.get_tensor("model.layers.0.mlp.down_proj.weight.fp8").dtype == torch.float8_e4m3fn
        assert {"model.embed_tokens.weight.fp8", "model.layers.1.self_attn.q_proj.weight.fp8_scale"} <= names
    finally:
        bundle.release()
