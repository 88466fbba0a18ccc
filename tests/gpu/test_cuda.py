"""CUDA path: Triton kernels against the torch reference, CUDA graphs against eager, and greedy
output against HF transformers on the GPU. Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import FAMILIES, make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(8, 8, 64), (16, 8, 128), (32, 8, 128), (14, 2, 64), (9, 3, 64)]
)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_decode_kernel_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    check_paged_decode_kernel(dtype, heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("splits", [2, 4, -64, -256, -128])
@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_paged_decode_tilings_match_reference(splits, block_n):
    """The launch's tilings (equal splits, fixed-length splits of -N tokens, tile lengths) give the
    reference attention too."""
    check_paged_decode_kernel(torch.bfloat16, 16, 8, 128, 16, splits=splits, block_n=block_n)


def _query(gen, rows: int, heads: int, kv_heads: int, head_dim: int, dtype, strided: bool) -> torch.Tensor:
    """[rows, heads, head_dim] on CUDA: contiguous, or (``strided``) the q part of a fused qkv row, as
    a model without RoPE (Nemotron-H) hands it over."""
    width = (heads + 2 * kv_heads if strided else heads) * head_dim
    fused = torch.randn(rows, width, generator=gen).to("cuda", dtype)
    return fused[:, : heads * head_dim].view(rows, heads, head_dim)


def check_paged_decode_kernel(dtype, heads, kv_heads, head_dim, block_size, strided=False, **tiling):
    from trtedge.runtime.ops.attention import TorchAttention
    from trtedge.runtime.ops.triton_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(heads * 1000 + block_size)
    num_blocks = 300
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    context_lens = [1, 7, 64, 129, 1000, 33]
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-c // block_size)].cuda() for c in context_lens]
    q = _query(gen, len(context_lens), heads, kv_heads, head_dim, dtype, strided)
    ref_backend = TorchAttention(head_dim**-0.5)
    ref = torch.stack(
        [
            ref_backend._attend(
                q[i : i + 1].float(),
                k_cache[t].flatten(0, 1)[:c].float(),
                v_cache[t].flatten(0, 1)[:c].float(),
                c - 1,
            )[0]
            for i, (t, c) in enumerate(zip(tables, context_lens))
        ]
    )
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    out = paged_decode_attention(
        q, k_cache, v_cache, padded, torch.tensor(context_lens, device="cuda"), head_dim**-0.5, **tiling
    )
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), rel


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_64_tokens_match_transformers_on_gpu(tiny):
    import transformers

    from trtedge import LLM, SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    ids = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]).cuda(), max_new_tokens=64, do_sample=False, pad_token_id=0)
    with LLM(str(tiny), dtype="float32", device="cuda", max_kv_cache_capacity=256, max_input_len=128) as llm:
        out = llm.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert out.token_ids == ref[0, len(ids) :].tolist()


def test_cuda_graphs_equal_eager_in_a_batch(tiny):
    from trtedge import LLM, SamplingParams

    prompts = [
        torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)
    ]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outputs = []
    for eager in (False, True):
        with LLM(
            str(tiny),
            dtype="bfloat16",
            device="cuda",
            max_kv_cache_capacity=128,
            max_input_len=64,
            enable_in_flight_batching=True,
            max_batch_size=4,
            enforce_eager=eager,
        ) as llm:
            outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_decode_step_matches_reference_path(tiny, dtype):
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    from trtedge.runtime.ops.attention import AttentionBatch

    model = load_model(
        resolve_checkpoint(str(tiny)), dtype=dtype, device="cuda", weights="float", max_positions=256
    )
    cfg = model.cfg
    block_size = 4
    kv = torch.randn(cfg.num_layers, 2, 64, block_size, cfg.num_kv_heads, cfg.head_dim, device="cuda").to(
        model.dtype
    )
    kv_ref = kv.clone()
    context_lens = [5, 17, 9]
    tables = [torch.tensor(t, device="cuda") for t in ([7, 3], [10, 11, 40, 2, 12], [20, 21, 22])]
    slots = [
        int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
        for t, c in zip(tables, context_lens)
    ]
    batch = AttentionBatch(torch.tensor(slots, device="cuda"), [1, 1, 1], context_lens, tables, block_size)
    batch.tables_tensor = batch.padded_block_tables()
    batch.context_lens_tensor = torch.tensor(context_lens, device="cuda")
    ids = torch.tensor([5, 9, 300], device="cuda")
    pos = torch.tensor([c - 1 for c in context_lens], device="cuda")
    fused = model.forward(ids, pos, [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)], batch)
    saved, model.decode_kernels = model.decode_kernels, None
    try:
        ref = model.forward(ids, pos, [(kv_ref[i, 0], kv_ref[i, 1]) for i in range(cfg.num_layers)], batch)
    finally:
        model.decode_kernels = saved
    rel = ((fused.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (2e-2 if dtype == "bfloat16" else 1e-5), rel


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(
    "n,k,bias", [(4096, 1024, False), (1024, 2048, True), (6144, 1024, False), (200, 96, True)]
)
def test_skinny_linear_matches_dense_product(rows, n, k, bias):
    import torch.nn.functional as F

    from trtedge.runtime.ops.triton_gemv import SkinnyLinear, candidates

    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(n, generator=gen).to("cuda", torch.bfloat16) if bias else None
    lin = SkinnyLinear(w, b)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    for plan in candidates(n, k, rows=rows) or [(32, 32, 1)]:  # one row: the vector kernel's too
        lin._reserve(plan)
        for _ in range(2):  # a second call: the split-K counters must have reset themselves
            out = lin.launch(x, plan)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (plan, rel)
    eager = lin(x)  # times the plans, keeps the fastest
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lin(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert int(lin.counts.sum()) == 0


@pytest.mark.parametrize(
    "n,k,bias", [(4096, 1024, False), (1024, 3072, True), (200, 96, True), (6144, 4096, False)]
)
def test_vector_product_matches_dense_product(n, k, bias):
    """The one-row kernel (no tensor cores) at every tiling shape it takes: looped and unrolled
    spans, split-K (whose counters reset for the next call), ragged N and K (masked tiles)."""
    import torch.nn.functional as F

    from trtedge.runtime.ops.triton_gemv import SkinnyLinear

    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(n, generator=gen).to("cuda", torch.bfloat16) if bias else None
    lin = SkinnyLinear(w, b)
    x = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    for plan in [(16, 256, 1), (32, 256, 4), (64, 128, 2), (16, 512, 8), (32, 64, 3)]:
        if k // plan[2] < plan[1] // 4:
            continue
        lin._reserve(plan)
        for unroll in (False, True):
            for _ in range(2):
                out = lin.launch_vector(x, plan, unroll=unroll)
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel < 1e-2, (plan, unroll, rel)
    assert int(lin.counts.sum()) == 0


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("inter,k,bias", [(3072, 1024, False), (200, 96, True)])
def test_silu_epilogue_matches_product_then_silu_mul(rows, inter, k, bias):
    """A [gate; up] product with SiLU-mul in its epilogue = the product, then the unfused kernel,
    for every tiling (split-K counters reset), eagerly and replayed from a graph."""
    import torch.nn.functional as F

    from trtedge.runtime.ops.triton_fused import TritonDecodeKernels
    from trtedge.runtime.ops.triton_gemv import SkinnyLinear, candidates

    gen = torch.Generator().manual_seed(inter + rows)
    w = (torch.randn(2 * inter, k, generator=gen) * k**-0.5).to("cuda", torch.bfloat16)
    b = torch.randn(2 * inter, generator=gen).to("cuda", torch.bfloat16) if bias else None
    lin = SkinnyLinear(w, b)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    kernels = TritonDecodeKernels()
    ref = torch.empty(rows, inter, dtype=torch.bfloat16, device="cuda")
    kernels.silu_mul(F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16(), ref)
    for plan in candidates(inter, k) or [(32, 32, 1)]:
        lin._reserve(plan)
        for _ in range(2):
            out = lin.launch(x, plan, silu_out=True)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2, plan
    eager = lin.silu_gated(x, kernels.silu_mul)  # times the epilogue against the unfused pair
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lin.silu_gated(x, kernels.silu_mul)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert int(lin.counts.sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (14, 2, 64), (8, 8, 64), (32, 4, 128)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_prefill_kernel_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    check_paged_prefill_kernel(dtype, heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (14, 2, 64)])
def test_attention_kernels_read_a_query_that_is_a_view_of_a_fused_qkv(dtype, heads, kv_heads, head_dim):
    """Nemotron-H's attention has no RoPE: its q is a strided view of the qkv projection. The kernels
    once addressed it as dense [T, H, D] (reading other rows' q, k and v), which the flat attention of
    a tiny random model hid within 1e-3 of the logprobs."""
    check_paged_decode_kernel(dtype, heads, kv_heads, head_dim, 16, strided=True)
    check_paged_prefill_kernel(dtype, heads, kv_heads, head_dim, 16, strided=True)


def check_paged_prefill_kernel(dtype, heads, kv_heads, head_dim, block_size, strided=False):
    from trtedge.runtime.ops.attention import AttentionBatch, TorchAttention
    from trtedge.runtime.ops.triton_prefill import paged_prefill_attention, plan_tiles

    gen = torch.Generator().manual_seed(heads * 100 + block_size)
    num_blocks = 400
    query_lens = [1, 200, 64, 37, 129, 5]
    context_lens = [50, 200, 300, 37, 1000, 5]  # reused prefixes where context > query
    perm, tables, used = torch.randperm(num_blocks, generator=gen), [], 0
    for c in context_lens:
        count = -(-c // block_size)
        tables.append(perm[used : used + count].cuda())
        used += count
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    total = sum(query_lens)
    q = _query(gen, total, heads, kv_heads, head_dim, dtype, strided)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    slots = [
        int(t[p // block_size]) * block_size + p % block_size
        for t, ql, c in zip(tables, query_lens, context_lens)
        for p in range(c - ql, c)
    ]
    batch = AttentionBatch(torch.tensor(slots, device="cuda"), query_lens, context_lens, tables, block_size)
    ref_k, ref_v = k_cache.float(), v_cache.float()
    ref = TorchAttention(head_dim**-0.5)(q.float(), k.float(), v.float(), ref_k, ref_v, batch)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
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
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), rel
