"""Quantized weights on CUDA: the fp8 / int8 / int4 Triton products against their torch references
(every tiling, split-K included), the prefill products, CUDA graph replay, and whole models served
from fp8 / int4 bundles and pre-quantized checkpoints. Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.prequantized_tiny import write_dequantized, write_prequantized
from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.artifacts.quantize import QuantizedTensor, quantize_fp8, quantize_int4, quantize_int8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [(96, 256), (1024, 4096), (4096, 1024), (151, 512), (6144, 4096)]
QUICK_SHAPES = [(1024, 4096), (151, 512)]
# the default run's tilings: the fallback, the widest (most shared memory), split-K, one-row ones
# (triton_quant's and triton_quant_gemv's)
QUICK_W8 = {
    (32, 128, 1, 4, 0),
    (128, 256, 1, 8, 0),
    (32, 256, 4, 4, 0),
    (32, 128, 8, 4, 0),
    (32, 256, 4, 4, 2),
    (64, 256, 4, 4, 3),
    (32, 256, 4, 4, 4),
}
QUICK_INT4 = {
    (32, 128, 1, 4, 0), (64, 512, 1, 8, 1), (128, 256, 1, 8, 0), (32, 256, 4, 4, 1), (32, 256, 8, 4, 0),
    (32, 512, 4, 4, 2), (64, 256, 4, 4, 3), (64, 256, 1, 4, 3),
}  # fmt: skip


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _plans(table, n, k, rows, only=None):
    from trtedge.runtime.ops import triton_quant as tq

    plans = [p for p in tq.candidates(table, n, k) if tq.fits(p, rows)]
    return [p for p in plans if only is None or p in only]


def _close(out, ref):
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item() + 1e-3, err


def _w8_weights(w):
    fp8 = quantize_fp8(w)
    blocks = QuantizedTensor("fp8", fp8.data, fp8.scale.repeat(1, w.shape[1] // 128).contiguous())
    nvfp4_like = QuantizedTensor("fp8", fp8.data, fp8.scale.repeat(1, w.shape[1] // 16).contiguous())
    return {"fp8-row": fp8, "fp8-block128": blocks, "fp8-block16": nvfp4_like, "int8": quantize_int8(w)}


def _check_w8(shape, rows, only):
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops.quant_linear import fp8_supported

    n, k = shape
    w, bias = _weight(n, k, n + k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    for name, q in _w8_weights(w).items():
        if name.startswith("fp8") and not fp8_supported(x.device):
            continue
        q = q.to(x.device)
        if q.format == "int8":
            q = QuantizedTensor("int8", q.data, q.scale.reshape(-1, 1).contiguous())
        ref = tq.w8_reference(x, q, bias.cuda())
        for plan in _plans(tq.W8_CANDIDATES, n, k, rows, only):
            ws = tq.Workspace(n, k, tq.W8_CANDIDATES, x.device)
            for _ in range(2):  # the split-K counters reset themselves
                _close(tq.w8_product(x, q, bias.cuda().bfloat16(), plan, ws), ref)


@pytest.mark.parametrize("shape", QUICK_SHAPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_w8_products_match_the_reference(shape, rows):
    _check_w8(shape, rows, QUICK_W8)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_w8_products_match_the_reference_for_every_tiling(shape, rows):
    _check_w8(shape, rows, None)


def _check_int4(shape, rows, only):
    from trtedge.runtime.ops import triton_quant as tq

    n, k = shape
    w, bias = _weight(n, k, n * k)
    q = tq.int4_gpu_layout(quantize_int4(w).to(torch.device("cuda")))
    torch.testing.assert_close(tq.int4_gpu_dequantize(q).cpu(), quantize_int4(w).dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(
        tq.int4_dequantize(q, torch.float32), tq.int4_gpu_dequantize(q), rtol=0, atol=0
    )
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = tq.int4_reference(x, q, bias.cuda())
    for plan in _plans(tq.INT4_CANDIDATES, n, k, rows, only):
        ws = tq.Workspace(n, k, tq.INT4_CANDIDATES, x.device)
        for _ in range(2):
            _close(tq.int4_product(x, q, bias.cuda().bfloat16(), plan, ws), ref)


@pytest.mark.parametrize("shape", QUICK_SHAPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_int4_products_match_the_reference(shape, rows):
    _check_int4(shape, rows, QUICK_INT4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_int4_products_match_the_reference_for_every_tiling(shape, rows):
    _check_int4(shape, rows, None)


GEMV_PLANS = [(32, 256, 1, 4), (64, 256, 4, 4), (128, 256, 2, 8), (64, 512, 3, 8)]


@pytest.mark.parametrize("seed", range(3))
def test_one_row_products_match_the_reference_on_random_shapes(seed):
    """triton_quant_gemv's batch-1 products (fp8 / int8 both modes, int4 with inline-PTX nibbles and
    with Triton's casts) at random sizes: ragged column tiles and K tails, splits with empty shares,
    bias."""
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops import triton_quant_gemv as tg
    from trtedge.runtime.ops.quant_linear import fp8_supported

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(17, 700, (1,), generator=g))
    k = 64 * int(torch.randint(2, 40, (1,), generator=g))
    w, bias = _weight(n, k, seed)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * 4
    b16 = bias.cuda().bfloat16()
    ws = tq.Workspace(n, k, [(16, 16, 8, 4, 0)], x.device)
    ws.partials = torch.empty(8 * 16 * n, device=x.device)
    weights = {"int8": quantize_int8(w)}
    if fp8_supported(x.device):
        weights["fp8"] = quantize_fp8(w)
    for q in weights.values():
        q = q.to(x.device)
        q = QuantizedTensor(q.format, q.data, q.scale.reshape(-1, 1).contiguous())
        ref = tq.w8_reference(x, q, bias.cuda())
        for plan in GEMV_PLANS:
            for mode in (0, 1):
                for _ in range(2):  # the split-K counters reset themselves
                    _close(tg.w8_gemv(x, q, b16, plan, ws, mode), ref)
    q = tq.int4_gpu_layout(quantize_int4(w).to(x.device))
    ref = tq.int4_reference(x, q, bias.cuda())
    for plan in GEMV_PLANS:
        for convert in (True, False):
            for _ in range(2):
                _close(tg.int4_gemv(x, q, b16, plan, ws, convert), ref)


@pytest.mark.parametrize("shape", [(4096, 1024), (151, 512)])
@pytest.mark.parametrize("rows", [65, 2048])
def test_prefill_products_dequantize_per_tile_and_match_the_reference(shape, rows):
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops import triton_quant_prefill as tp
    from trtedge.runtime.ops.quant_linear import fp8_supported

    n, k = shape
    w, bias = _weight(n, k, n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    for name, q in _w8_weights(w).items():
        if name.startswith("fp8") and not fp8_supported(x.device):
            continue
        q = q.to(x.device)
        if q.format == "int8":
            q = QuantizedTensor("int8", q.data, q.scale.reshape(-1, 1).contiguous())
        _close(tp.w8_gemm(x, q, bias.cuda().bfloat16()), tq.w8_reference(x, q, bias.cuda()))
        _close(tp.w8_gemm(x, q, None), tq.w8_reference(x, q, None))
    q = tq.int4_gpu_layout(quantize_int4(w).to(torch.device("cuda")))
    _close(tp.int4_gemm(x, q, bias.cuda().bfloat16()), tq.int4_reference(x, q, bias.cuda()))
    _close(tp.int4_gemm(x.half(), q, None), tq.int4_reference(x, q, None))


def test_fp8_activation_rows_match_the_reference():
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops.quant_linear import fp8_supported

    if not fp8_supported(torch.device("cuda")):
        pytest.skip("E4M3 needs compute capability 8.9")
    for k in (4096, 12288, 1000, 28672):  # one row a program in 4, 8 and 16 warps
        x = torch.randn(37, k, device="cuda", dtype=torch.bfloat16) * 3
        x[5] = 0
        q, scale = tq.fp8_rows(x)
        _same_e4m3_rows(q, scale, *tq.fp8_rows_reference(x))


def _same_e4m3_rows(q, scale, ref_q, ref_scale):
    """Triton's float32 division is not IEEE-rounded: a value on an E4M3 rounding boundary may land
    one step (1/16-1/8 of it; 2**-9 among the subnormals) from torch's, rarely (1 of 454,656 on the H200)."""
    torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=0.125, atol=2**-9)
    assert (q.float() != ref_q.float()).float().mean() < 1e-4


def _near_e4m3_rows(q, scale, ref_q, ref_scale):
    """Fused kernels round the op's bf16 result with approximate float32 math (rsqrt, sigmoid): a
    bf16 value one unit off may land on the neighbouring E4M3 value, one step (1/8) away."""
    torch.testing.assert_close(scale, ref_scale, rtol=1e-2, atol=0)
    got, want = q.float() * scale, ref_q.float() * ref_scale
    assert ((got - want).abs() <= 0.13 * want.abs() + ref_scale * 2**-9).all()  # 2**-9: E4M3's least step
    assert (q.float() != ref_q.float()).float().mean() < 1e-3


@pytest.mark.parametrize("k", [4096, 1000])
def test_fused_norm_and_silu_mul_rows_match_the_ops_then_the_quantization(k):
    from trtedge.runtime.models.layers import rms_norm
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops.quant_linear import fp8_supported

    if not fp8_supported(torch.device("cuda")):
        pytest.skip("E4M3 needs compute capability 8.9")
    x = torch.randn(37, k, device="cuda", dtype=torch.bfloat16) * 3
    delta = torch.randn_like(x)
    w = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    ref = tq.fp8_rows_reference(rms_norm(x, w, 1e-6))
    _near_e4m3_rows(*tq.fp8_norm_rows(x.clone(), None, w, 1e-6), *ref)
    summed = x + delta
    inplace = x.clone()
    _near_e4m3_rows(
        *tq.fp8_norm_rows(inplace, delta, w, 1e-6), *tq.fp8_rows_reference(rms_norm(summed, w, 1e-6))
    )
    torch.testing.assert_close(inplace, summed, rtol=0, atol=0)  # the residual stream, updated
    gate_up = torch.randn(37, 2 * k, device="cuda", dtype=torch.bfloat16) * 2
    gate, up = gate_up.chunk(2, dim=-1)
    _near_e4m3_rows(
        *tq.fp8_silu_mul_rows(gate_up), *tq.fp8_rows_reference(torch.nn.functional.silu(gate) * up)
    )


@pytest.mark.parametrize("rows", [333, 2048])
def test_scaled_product_takes_rows_quantized_by_the_fused_kernels(rows):
    from trtedge.runtime.artifacts.quantize import quantize
    from trtedge.runtime.models.layers import rms_norm
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops.linear import make_linear
    from trtedge.runtime.ops.quant_linear import scaled_mm_supported

    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip("row-wise scaled FP8 products need compute capability 9.0")
    w, _ = _weight(1024, 2048, rows)
    layer = make_linear(quantize(w.cuda(), "fp8"), None)
    assert layer.scaled_mm
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    norm = (torch.rand(2048, device="cuda") + 0.5).bfloat16()
    normed = rms_norm(x, norm, 1e-6)
    xq, sx = tq.fp8_rows_reference(normed)
    ref = torch.nn.functional.linear(xq.float() * sx, layer.dequantized(torch.float32))
    _close(layer.scaled_product(*tq.fp8_norm_rows(x, None, norm, 1e-6)), ref)
    torch.testing.assert_close(layer.scaled_product(*tq.fp8_rows(normed)), layer(normed), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 7, 40, 333])
def test_layers_match_the_dequantized_product_eager_and_in_a_graph(fmt, rows):
    from trtedge.runtime.artifacts.quantize import quantize
    from trtedge.runtime.ops.linear import make_linear
    from trtedge.runtime.ops.quant_linear import fp8_supported

    if fmt == "fp8" and not fp8_supported(torch.device("cuda")):
        pytest.skip("E4M3 needs compute capability 8.9")
    w, bias = _weight(1024, 2048, rows)
    layer = make_linear(quantize(w.cuda(), fmt), bias.cuda().bfloat16())
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.dequantized(torch.float32), bias.cuda())
    eager = layer(x)
    # fp8 prefill (over 64 rows) scales the activations to E4M3 too (Hopper's FP8 product): a few percent
    tol = 4e-2 if fmt == "fp8" and rows > 64 else 1e-2
    assert (eager.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


def _prompts():
    return [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40)]


def _llm(model, tmp_path, **kw):
    from trtedge import LLM

    return LLM(str(model), dtype="bfloat16", device="cuda", max_kv_cache_capacity=128, max_input_len=64,
               max_batch_size=2, cache_dir=tmp_path / "cache", **kw)  # fmt: skip


def _greedy(model, tmp_path, **kw):
    from trtedge import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with _llm(model, tmp_path, **kw) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), params)]


def _assert_follows(model, reference, tmp_path):
    """``reference``'s greedy continuations, teacher-forced through ``model``: its most likely token is
    the reference's at 90% of the positions or more, and elsewhere within 0.05 nats of it (a near tie
    that two roundings of the same weights may break either way; a wrong model misses most)."""
    from trtedge import SamplingParams

    prompts = _prompts()
    continuations = _greedy(reference, tmp_path)
    with _llm(model, tmp_path) as llm:
        scored = llm.generate(
            [p + c for p, c in zip(prompts, continuations)], SamplingParams(max_tokens=1, prompt_logprobs=1)
        )
    entries = [e for p, out in zip(prompts, scored) for e in out.prompt_logprobs[len(p) :]]
    gaps = [e.top[0][1] - e.logprob for e in entries]
    assert sum(e.rank == 1 for e in entries) >= 0.9 * len(entries), gaps
    assert max(gaps) < 0.05, gaps


@pytest.mark.parametrize("fmt", ["awq", "gptq", "modelopt-nvfp4", "compressed-tensors-fp8-block"])
def test_prequantized_checkpoints_serve_the_dequantized_models_tokens_on_cuda(tiny, tmp_path, fmt):
    path, reference = write_prequantized(tiny, tmp_path / "q", fmt)
    float_path = write_dequantized(tiny, tmp_path / "float", reference)
    _assert_follows(path, float_path, tmp_path)


@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_weights_flag_on_cuda_runs_the_quantized_layers_with_cuda_graphs(tiny, tmp_path, weights):
    from trtedge.runtime.artifacts.bundle import BuildProfile, prepare_bundle
    from trtedge.runtime.models import load_model
    from trtedge.runtime.ops.quant_linear import Fp8Linear, Int4CudaLinear

    bundle = prepare_bundle(str(tiny), BuildProfile(weights=weights), cache_dir=tmp_path / "cache")
    try:
        model = load_model(bundle, dtype="bfloat16", device="cuda", weights=weights, max_positions=128)
        assert isinstance(model.layers[0].mlp.down, Fp8Linear if weights == "fp8" else Int4CudaLinear)
    finally:
        bundle.release()
    assert _greedy(tiny, tmp_path, weights=weights) == _greedy(
        tiny, tmp_path, weights=weights, enforce_eager=True
    )


def test_an_fp8_moe_checkpoint_runs_its_experts_in_the_grouped_fp8_kernel(tmp_path):
    from trtedge.runtime.artifacts.bundle import BuildProfile, prepare_bundle
    from trtedge.runtime.models import load_model

    if not torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("E4M3 needs compute capability 8.9")
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    path, reference = write_prequantized(moe, tmp_path / "q", "compressed-tensors-fp8-channel")
    float_path = write_dequantized(moe, tmp_path / "float", reference)
    bundle = prepare_bundle(str(path), BuildProfile(), cache_dir=tmp_path / "cache")
    try:
        model = load_model(bundle, dtype="bfloat16", device="cuda", weights="auto", max_positions=128)
        sparse = model.layers[0].mlp
        assert sparse.grouped_kernel and sparse.scales is not None
        assert sparse.w_gate_up.dtype == torch.float8_e4m3fn
    finally:
        bundle.release()
    _assert_follows(path, float_path, tmp_path)
