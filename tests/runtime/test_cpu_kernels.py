"""Native CPU kernels against the torch reference path on the same inputs."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.artifacts.quantize import quantize_int8
from trtedge.runtime.models import load_model
from trtedge.runtime.ops import cpu_kernels, kv_fp8
from trtedge.runtime.ops.attention import AttentionBatch
from trtedge.runtime.ops.linear import DenseLinear, Int8Linear

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the native CPU kernels")


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 33])
@pytest.mark.parametrize("shape", [(64, 48), (130, 576), (7, 37)])
def test_int8_linear_matches_dequantized_product(rows, shape):
    n, k = shape
    torch.manual_seed(0)
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    layer = Int8Linear(weight, bias, lib)
    ref = torch.nn.functional.linear(x, layer.dequantized(), bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)
    q = quantize_int8(weight)
    assert (q.dequantize() - weight).abs().max() <= q.scale.max() / 2 + 1e-6


@pytest.mark.parametrize("num_seqs", [1, 6])  # 6: past the kernels' groups of 4 activation rows
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("weights", ["float", "int8", "int4"])
def test_native_batched_decode_matches_reference(tmp_path, family, weights, num_seqs):
    path = make_tiny_checkpoint(tmp_path / family, family)
    model = load_model(
        resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights=weights, max_positions=256
    )
    cfg = model.cfg
    block_size, num_blocks = 4, 64
    kv = torch.randn(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    kv_ref = kv.clone()
    caches_ref = [(kv_ref[i, 0], kv_ref[i, 1]) for i in range(cfg.num_layers)]
    # Sequences of different lengths on scattered blocks, one new token each.
    context_lens = [17, 5, 9, 1, 12, 4][:num_seqs]
    tables = [[10, 11, 40, 2, 12], [7, 3], [20, 21, 22], [30], [31, 32, 33], [50]][:num_seqs]
    tables = [torch.tensor(t) for t in tables]
    slots = [
        int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
        for t, c in zip(tables, context_lens)
    ]
    batch = AttentionBatch(torch.tensor(slots), [1] * num_seqs, context_lens, tables, block_size)
    ids, pos = torch.tensor([5, 9, 300, 7, 8, 9][:num_seqs]), torch.tensor([c - 1 for c in context_lens])
    # float weights: the fused per-op kernels; int8 / int4: the whole step as one native call
    assert (model.native_step is not None) == (weights != "float")
    native = model.forward(ids, pos, caches, batch)
    saved = model.decode_kernels, model.native_step
    model.decode_kernels = model.native_step = None
    try:
        reference = model.forward(ids, pos, caches_ref, batch)
        if weights == "int4":  # the same int16 activation blocks, one product at a time
            model.decode_kernels = saved[0]
            kv_ops = kv.clone()
            per_op = model.forward(
                ids, pos, [(kv_ops[i, 0], kv_ops[i, 1]) for i in range(cfg.num_layers)], batch
            )
            torch.testing.assert_close(native, per_op, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kv, kv_ops, rtol=1e-5, atol=1e-5)
    finally:
        model.decode_kernels, model.native_step = saved
    # int4 products quantize activations to int16 per block of 32 (relative error ~1e-4)
    tol = 2e-3 if weights == "int4" else 1e-4
    torch.testing.assert_close(native, reference, rtol=tol, atol=tol)
    torch.testing.assert_close(kv, kv_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])  # int8: kv_fp8's rows
@pytest.mark.parametrize("head_dim", [64, 128, 24, 20])  # 20: not a multiple of 8, the portable loops
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (18, 1)])  # 18 on 1: groups of 8, 8 and 2 heads
def test_paged_decode_attention_matches_a_float64_reference(dtype, head_dim, block_size, heads, kv_heads):
    # Contexts that end mid-block and cross blocks, scattered tables, query heads that share a KV
    # head, and sliding windows whose first key sits mid-block.
    torch.manual_seed(0)
    num_blocks = 40
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
    if dtype == torch.int8:  # rows of int8 values and their float32 scale; the reference reads them widened
        k_cache, v_cache = kv_fp8.quantize_int8(k_cache), kv_fp8.quantize_int8(v_cache)
        k_ref, v_ref = kv_fp8.dequantize(k_cache), kv_fp8.dequantize(v_cache)
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        k_ref, v_ref = k_cache, v_cache
    context_lens = torch.tensor([1, 5, 37, 70])
    tables = torch.stack([torch.randperm(num_blocks)[: num_blocks // 2] for _ in context_lens])
    tables = tables[:, : (int(context_lens.max()) + block_size - 1) // block_size].contiguous()
    q = torch.randn(len(context_lens), heads, head_dim)
    scale = head_dim**-0.5
    for window in (0, 3, 30):
        outs, old = [], torch.get_num_threads()
        try:  # at 5 threads a chunk takes part of a KV head's query heads: the same bits
            for threads in (1, 5):
                torch.set_num_threads(threads)
                outs.append(torch.empty_like(q))
                cpu_kernels.paged_decode_attention(
                    lib, q, k_cache, v_cache, tables, context_lens, block_size, scale, outs[-1], window
                )
        finally:
            torch.set_num_threads(old)
        out = outs[0]
        assert torch.equal(outs[1], out)
        for b, ctx in enumerate(context_lens.tolist()):
            first = max(0, ctx - window) if window else 0
            slots = [(int(tables[b, t // block_size]), t % block_size) for t in range(first, ctx)]
            k = torch.stack([k_ref[blk, off] for blk, off in slots]).double()  # [T, kv_heads, D]
            v = torch.stack([v_ref[blk, off] for blk, off in slots]).double()
            group = heads // kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * scale, dim=-1)
            ref = torch.einsum("ht,thd->hd", weights, v)
            torch.testing.assert_close(out[b].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_native_decode_step_is_the_same_at_any_thread_count(tmp_path, weights):
    # the step's work queue hands chunks to whichever thread asks: each chunk and each serial part
    # is computed the same way whoever runs it, so the output is bit-identical (5 threads: more
    # than the cores and than some phases' chunks)
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    model = load_model(
        resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights=weights, max_positions=64
    )
    cfg = model.cfg
    assert model.native_step is not None
    block_size, context_lens = 4, [9, 3, 14]
    tables = [torch.tensor([5, 1, 7, 2]), torch.tensor([3]), torch.tensor([8, 9, 10, 11])]
    slots = [
        int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
        for t, c in zip(tables, context_lens)
    ]
    batch = AttentionBatch(torch.tensor(slots), [1] * 3, context_lens, tables, block_size)
    ids, pos = torch.tensor([5, 9, 30]), torch.tensor([c - 1 for c in context_lens])
    kv = torch.randn(cfg.num_layers, 2, 16, block_size, cfg.num_kv_heads, cfg.head_dim)
    results, old = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            cache = kv.clone()
            out = model.forward(ids, pos, [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)], batch)
            results.append((out, cache))
    finally:
        torch.set_num_threads(old)
    for out, cache in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(cache, results[0][1])
    assert not torch.equal(results[0][1], kv)  # the step wrote its keys and values


@pytest.mark.parametrize("rows", [1, 3, 70])  # 70: past the kernel's rows, the float32 BLAS path
def test_bfloat16_weights_sum_in_float32(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 576).bfloat16(), torch.randn(96), torch.randn(rows, 576) * 3
    out = DenseLinear(weight, bias)(x)
    exact = x.bfloat16().double() @ weight.double().T + bias.double()
    assert out.dtype == torch.float32
    # float32 sums of bfloat16 inputs: far closer than a bfloat16 result (relative 2**-9)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)


def test_bfloat16_model_keeps_float32_activations(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    ckpt = resolve_checkpoint(str(path))
    model = load_model(ckpt, dtype="bfloat16", device="cpu", weights="auto", max_positions=64)
    reference = load_model(ckpt, dtype="float32", device="cpu", weights="auto", max_positions=64)
    assert model.layers[0].qkv.weight.dtype == torch.bfloat16 and model.act_dtype == torch.float32
    assert model.layers[0].input_norm.dtype == torch.float32
    cfg = model.cfg
    ids = torch.tensor([3, 17, 42, 5])
    batch = AttentionBatch(torch.arange(4), [4], [4], [torch.tensor([0])], 4)
    outs = []
    for m in (model, reference):
        kv = torch.zeros(cfg.num_layers, 2, 1, 4, cfg.num_kv_heads, cfg.head_dim)
        caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
        outs.append(m.logits(m.forward(ids, torch.arange(4), caches, batch)))
    assert outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)


def test_the_compiled_library_is_named_for_the_cpu_it_was_built_on():
    # -march=native: a kernel cache shared by two machines must not give one the other's instructions
    from trtedge.runtime.ops.cpu_kernels import _cpu_identity, library_name

    here = _cpu_identity()
    assert here and library_name("src", "cc", here) == library_name("src", "cc", here)
    assert library_name("src", "cc", here) != library_name("src", "cc", here.replace("avx2", "sse2") + " x")
    assert library_name("src", "cc", here) != library_name("src2", "cc", here)
    assert library_name("src", "cc", here) != library_name("src", "gcc", here)
