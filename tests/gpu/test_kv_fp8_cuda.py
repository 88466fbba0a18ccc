"""The fp8 KV cache on CUDA (--kv-cache-dtype fp8): the paged decode and prefill kernels and the fused
decode store against the torch reference on the same E4M3 caches, and a tiny model served with it
(CUDA graphs equal eager). Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _fp8_or_skip():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("E4M3 needs compute capability 8.9")


def _caches(num_blocks, block_size, kv_heads, head_dim, gen, spread=1.0):
    from trtedge.runtime.ops import kv_fp8

    shape = (num_blocks, block_size, kv_heads, head_dim)
    # heads of very different magnitudes: each row's own scale keeps them all in range
    mags = torch.logspace(-2, 2, kv_heads)[None, None, :, None] * spread
    k = torch.randn(*shape, generator=gen) * mags
    v = torch.randn(*shape, generator=gen)
    return kv_fp8.quantize(k).cuda(), kv_fp8.quantize(v).cuda()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(16, 8, 128, 16), (14, 2, 64, 32)])
def test_paged_decode_kernel_reads_the_fp8_cache(heads, kv_heads, head_dim, block_size):
    from trtedge.runtime.ops import kv_fp8
    from trtedge.runtime.ops.attention import TorchAttention
    from trtedge.runtime.ops.triton_attention import paged_decode_attention

    _fp8_or_skip()
    gen = torch.Generator().manual_seed(heads + block_size)
    num_blocks = 200
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, head_dim, gen)
    context_lens = [1, 7, 64, 129, 1000, 33]
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-c // block_size)].cuda() for c in context_lens]
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    ref_backend = TorchAttention(head_dim**-0.5)
    ref = torch.stack(
        [
            ref_backend._attend(
                q[i : i + 1].float(),
                kv_fp8.dequantize(k_cache[t].flatten(0, 1)[:c]),
                kv_fp8.dequantize(v_cache[t].flatten(0, 1)[:c]),
                c - 1,
            )[0]
            for i, (t, c) in enumerate(zip(tables, context_lens))
        ]
    )
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    out = paged_decode_attention(
        q, k_cache, v_cache, padded, torch.tensor(context_lens, device="cuda"), head_dim**-0.5
    )
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128)])
def test_paged_prefill_kernel_reads_the_fp8_cache(heads, kv_heads, head_dim):
    from trtedge.runtime.ops import kv_fp8
    from trtedge.runtime.ops.attention import AttentionBatch, TorchAttention
    from trtedge.runtime.ops.triton_prefill import paged_prefill_attention, plan_tiles

    _fp8_or_skip()
    gen = torch.Generator().manual_seed(heads)
    block_size, num_blocks = 16, 300
    query_lens = [1, 200, 64, 37, 129]
    context_lens = [50, 200, 300, 37, 1000]
    perm, tables, used = torch.randperm(num_blocks, generator=gen), [], 0
    for c in context_lens:
        count = -(-c // block_size)
        tables.append(perm[used : used + count].cuda())
        used += count
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, head_dim, gen)
    total = sum(query_lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    k = (torch.randn(total, kv_heads, head_dim, generator=gen) * 4).to("cuda", torch.bfloat16)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    slots = [
        int(t[p // block_size]) * block_size + p % block_size
        for t, ql, c in zip(tables, query_lens, context_lens)
        for p in range(c - ql, c)
    ]
    batch = AttentionBatch(torch.tensor(slots, device="cuda"), query_lens, context_lens, tables, block_size)
    # the reference writes this step's rows in E4M3 and attends over the dequantized cache
    ref = TorchAttention(head_dim**-0.5)(q.float(), k.float(), v.float(), k_cache, v_cache, batch)
    stored = kv_fp8.dequantize(k_cache.view(-1, kv_heads, head_dim + 4)[batch.slot_mapping])
    assert ((stored - k.float()).abs() <= k.float().abs().amax(-1, keepdim=True) / 16).all()
    tiles, seqs = plan_tiles(query_lens, context_lens)
    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        batch.padded_block_tables(),
        torch.tensor(tiles, dtype=torch.int32, device="cuda").view(-1, 2),
        torch.tensor(seqs, dtype=torch.int32, device="cuda").view(-1, 3),
        head_dim**-0.5,
    )
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


def test_fused_decode_store_writes_the_fp8_layout():
    from trtedge.runtime.ops import kv_fp8
    from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

    _fp8_or_skip()
    heads, kv_heads, head_dim, block_size, tokens = 8, 2, 128, 16, 5
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(
        "cuda", torch.bfloat16
    )
    positions = torch.tensor([0, 3, 9, 17, 40], device="cuda")
    slots = torch.tensor([1, 18, 33, 50, 63], device="cuda")
    cos = torch.randn(64, head_dim, generator=gen).to("cuda", torch.bfloat16)
    sin = torch.randn(64, head_dim, generator=gen).to("cuda", torch.bfloat16)
    kernels = TritonDecodeKernels()
    out = {}
    for kv in ("auto", "fp8"):
        shape = kv_fp8.cache_shape((4, block_size, kv_heads, head_dim), kv)
        dtype = torch.uint8 if kv == "fp8" else torch.bfloat16
        k_cache = torch.zeros(shape, dtype=dtype, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        q = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        kernels.qkv_rope_store(qkv, heads, kv_heads, head_dim, positions, cos, sin, None, None, 1e-6, slots,
                               k_cache, v_cache, q)  # fmt: skip
        out[kv] = (k_cache, v_cache, q)
    assert torch.equal(out["auto"][2], out["fp8"][2])
    for i in range(2):
        plain = out["auto"][i].view(-1, kv_heads, head_dim)[slots].float()
        rows = out["fp8"][i].view(-1, kv_heads, head_dim + 4)[slots]
        err = (kv_fp8.dequantize(rows) - plain).abs()
        assert (err <= plain.abs().amax(-1, keepdim=True) / 16).all()  # within one E4M3 step
        torch.testing.assert_close(
            kv_fp8.dequantize(rows), kv_fp8.dequantize(kv_fp8.quantize(plain)), rtol=0.07, atol=1e-3
        )


def test_a_model_serves_from_an_fp8_kv_cache_with_cuda_graphs(tmp_path):
    from trtedge import LLM, SamplingParams

    _fp8_or_skip()
    tiny = make_tiny_checkpoint(tmp_path / "tiny", "qwen3")
    prompts = [
        torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40)
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        with LLM(str(tiny), dtype="bfloat16", device="cuda", kv_cache_dtype="fp8", max_kv_cache_capacity=128,
                 max_input_len=64, max_batch_size=2, cache_dir=tmp_path / "cache", enforce_eager=eager) as llm:  # fmt: skip
            info = llm.describe()
            runs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    # layers x (K, V) x kv heads x (head_dim E4M3 bytes + a float32 scale)
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * (32 + 4)
    assert runs[False] == runs[True] and all(len(t) == 24 for t in runs[False])
