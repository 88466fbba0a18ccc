"""CUDA kernels the newer families need, against their torch references: the grouped MoE matmuls
and sliding-window / soft-capped attention. (Greedy output of every tiny family against HF on the
GPU is in test_cuda.py.) Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _Cfg:
    model_type = "qwen3_moe"
    hidden_act = "silu"
    norm_topk_prob = True
    shared_expert_intermediate_size = 0

    def __init__(self, experts: int, top_k: int):
        self.num_experts, self.num_experts_per_tok = experts, top_k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4)])
def test_grouped_moe_kernel_matches_reference(dtype, tokens, experts, top_k):
    from trtedge.runtime.models.moe import SparseMoE, expert_names

    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 256, 96
    cfg = _Cfg(experts, top_k)
    router, names = expert_names(cfg)
    w = {router + ".weight": torch.randn(experts, hidden, generator=gen)}
    for gate, up, down in names:
        w[gate + ".weight"] = torch.randn(inter, hidden, generator=gen) * 0.05
        w[up + ".weight"] = torch.randn(inter, hidden, generator=gen) * 0.05
        w[down + ".weight"] = torch.randn(hidden, inter, generator=gen) * 0.05
    moe = SparseMoE(cfg, {k: v.to("cuda", dtype) for k, v in w.items()}, "float")
    assert moe.grouped_kernel
    h = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    weights, ids = moe.route(h)
    out = moe(h)
    ref = moe.grouped_reference(h, weights, ids)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel


@pytest.mark.parametrize("window,softcap", [(0, 30.0), (16, None), (40, 20.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_windowed_softcapped_attention_kernels_match_reference(window, softcap, dtype):
    from trtedge.runtime.ops.attention import TorchAttention
    from trtedge.runtime.ops.triton_attention import paged_decode_attention
    from trtedge.runtime.ops.triton_prefill import paged_prefill_attention, plan_tiles

    gen = torch.Generator().manual_seed(window)
    block_size, heads, kv_heads, head_dim, num_blocks = 16, 8, 2, 64, 80
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    query_lens, context_lens = [150, 7, 40], [150, 90, 300]
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-c // block_size)].cuda() for c in context_lens]
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    ref_backend = TorchAttention(head_dim**-0.5, window, softcap)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to("cuda", dtype)
    ref, start = [], 0
    for ql, c, t in zip(query_lens, context_lens, tables):
        keys, values = k_cache[t].flatten(0, 1)[:c].float(), v_cache[t].flatten(0, 1)[:c].float()
        ref.append(ref_backend._attend(q[start : start + ql].float(), keys, values, c - ql))
        start += ql
    ref = torch.cat(ref)
    tiles, seqs = plan_tiles(query_lens, context_lens)
    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        padded,
        torch.tensor(tiles, dtype=torch.int32, device="cuda").view(-1, 2),
        torch.tensor(seqs, dtype=torch.int32, device="cuda").view(-1, 3),
        head_dim**-0.5,
        window,
        softcap,
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol
    qd = torch.randn(len(context_lens), heads, head_dim, generator=gen).to("cuda", dtype)
    ref_d = torch.stack(
        [
            ref_backend._attend(
                qd[i : i + 1].float(),
                k_cache[t].flatten(0, 1)[:c].float(),
                v_cache[t].flatten(0, 1)[:c].float(),
                c - 1,
            )[0]
            for i, (t, c) in enumerate(zip(tables, context_lens))
        ]
    )
    out_d = paged_decode_attention(
        qd,
        k_cache,
        v_cache,
        padded,
        torch.tensor(context_lens, device="cuda"),
        head_dim**-0.5,
        window=window,
        softcap=softcap,
    )
    assert ((out_d.float() - ref_d).norm() / ref_d.norm()).item() < tol
