"""The decode products with their neighbours folded in (RMSNorm before, SiLU-mul before, the
residual add after) against the torch reference, and the fused decode step against the unfused one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tiny import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_fused_products_match_torch_reference(dtype, seed):
    from trtedge.runtime.models.layers import rms_norm
    from trtedge.runtime.ops.triton_gemv import SkinnyLinear, candidates

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 96, (), generator=gen)) * 16 + int(torch.randint(0, 16, (), generator=gen))
    k = int(torch.randint(2, 160, (), generator=gen)) * 16
    rows = [1, 2, 3, 5, 8, 16][seed]
    like = dict(device="cuda", dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(**like)
    bias = torch.randn(n, generator=gen).to(**like) if seed % 2 else None
    lin = SkinnyLinear(w, bias)
    x = torch.randn(rows, k, generator=gen).to(**like)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(**like)
    norm = (torch.rand(k, generator=gen) + 0.5).to(**like)
    residual = torch.randn(rows, n, generator=gen).to(**like)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    ref_norm = F.linear(rms_norm(x, norm, 1e-6).float(), w.float(), None if bias is None else bias.float())
    ref_down = (residual.float() + F.linear(act, w, bias).float()).to(dtype)
    for plan in candidates(n, k) or [(32, 32, 1)]:
        lin._reserve(plan)
        for _ in range(2):  # a second call: the split-K counters must have reset themselves
            out = lin.launch(x, plan, norm=norm, eps=1e-6)
            late = lin.launch(x, plan, norm=norm, eps=1e-6, late_norm=True)
            into = residual.clone()
            lin.launch(gate_up, plan, silu=True, residual=into)
        assert _rel(out, ref_norm) < 1e-2, plan
        assert _rel(late, ref_norm) < 1e-2, plan
        assert _rel(into, ref_down) < 1e-2, plan
    assert int(lin.counts.sum()) == 0
    into = residual.clone()
    eager = lin.fused(gate_up, silu=True, residual=into).clone()  # tunes the fused variant
    graph = torch.cuda.CUDAGraph()
    captured = residual.clone()
    with torch.cuda.graph(graph):
        lin.fused(gate_up, silu=True, residual=captured)
    captured.copy_(residual)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"])
def tiny(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _decode_batch(model, rows: int):
    """A decode step's operands for ``rows`` sequences of random lengths over a random KV cache:
    (ids, positions, batch, kv)."""
    from trtedge.runtime.ops.attention import AttentionBatch

    cfg = model.cfg
    block_size = 4
    gen = torch.Generator().manual_seed(rows)
    # 16 rows of up to 59 tokens take up to 240 blocks of 4
    kv = torch.randn(cfg.num_layers, 2, 256, block_size, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    kv = kv.to("cuda", model.dtype)
    context_lens = torch.randint(1, 60, (rows,), generator=gen).tolist()
    perm = torch.randperm(255, generator=gen) + 1
    tables, used = [], 0
    for c in context_lens:
        blocks = -(-c // block_size)
        tables.append(perm[used : used + blocks].cuda())
        used += blocks
    slots = [
        int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
        for t, c in zip(tables, context_lens)
    ]
    batch = AttentionBatch(torch.tensor(slots, device="cuda"), [1] * rows, context_lens, tables, block_size)
    batch.tables_tensor = batch.padded_block_tables()
    batch.context_lens_tensor = torch.tensor(context_lens, device="cuda")
    ids = torch.randint(3, 500, (rows,), generator=gen).cuda()
    pos = torch.tensor([c - 1 for c in context_lens], device="cuda")
    return ids, pos, batch, kv


def _step(model, ids, pos, batch, kv):
    """(the step's output, the KV cache after it) on a copy of ``kv``."""
    cache = kv.clone()
    layers = range(model.cfg.num_layers)
    return model.forward(ids, pos, [(cache[i, 0], cache[i, 1]) for i in layers], batch), cache


def _assert_fused_matches_unfused(model, operands, switch: str) -> torch.Tensor:
    """The step with ``model.<switch>`` on, then off: outputs and KV caches within bf16 rounding of
    each other. Returns the fused step's cache."""
    outs, caches = [], []
    for fused in (True, False):
        setattr(model, switch, fused)
        out, cache = _step(model, *operands)
        outs.append(out)
        caches.append(cache)
    assert _rel(outs[0], outs[1]) < 2e-2
    assert _rel(caches[0], caches[1]) < 2e-2
    return caches[0]


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fused_decode_step_matches_unfused_step(tiny, rows, monkeypatch):
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model

    monkeypatch.setenv("TRTEDGE_DECODE_FUSION", "1")
    model = load_model(
        resolve_checkpoint(str(tiny)), dtype="bfloat16", device="cuda", weights="float", max_positions=256
    )
    assert model.fused_products
    _assert_fused_matches_unfused(model, _decode_batch(model, rows), "fused_products")


def _prefill_batch(model, shape: list[tuple[int, int]]):
    """A prefill (or mixed) step's operands for sequences of (query rows, context length) over a random
    KV cache, with the varlen attention planned as the runner plans it: (ids, positions, batch, kv)."""
    from trtedge.runtime.ops import triton_prefill
    from trtedge.runtime.ops.attention import AttentionBatch

    cfg = model.cfg
    block_size = 4
    gen = torch.Generator().manual_seed(len(shape))
    kv = torch.randn(cfg.num_layers, 2, 128, block_size, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    kv = kv.to("cuda", model.dtype)
    perm = (torch.randperm(127, generator=gen) + 1).tolist()
    tables, slots, positions, used = [], [], [], 0
    for q, c in shape:
        blocks = -(-c // block_size)
        table = perm[used : used + blocks]
        used += blocks
        tables.append(table)
        for p in range(c - q, c):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    query_lens, context_lens = [q for q, _ in shape], [c for _, c in shape]
    batch = AttentionBatch(
        torch.tensor(slots, device="cuda"), query_lens, context_lens,
        [padded[i, : len(t)] for i, t in enumerate(tables)], block_size,
    )  # fmt: skip
    tiles, seqs = triton_prefill.plan_tiles(query_lens, context_lens)
    tiles_t = torch.tensor(tiles, dtype=torch.int32, device="cuda").view(-1, 2)
    batch.prefill_plan = (padded, tiles_t, torch.tensor(seqs, dtype=torch.int32, device="cuda").view(-1, 3))
    ids = torch.randint(3, 500, (len(slots),), generator=gen).cuda()
    return ids, torch.tensor(positions, device="cuda"), batch, kv


@pytest.mark.parametrize(
    "shape",
    [[(7, 7)], [(5, 5), (3, 11), (1, 9), (40, 40)]],
    ids=["one-prompt", "prompts-chunks-and-a-decode-row"],
)
def test_fused_prefill_step_matches_unfused_step(tiny, shape):
    """The CUDA prefill step through the fused norm / rope-store / SiLU-mul kernels equals the torch
    layer path (its reference): hidden states and the keys and values it stores."""
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model

    model = load_model(
        resolve_checkpoint(str(tiny)), dtype="bfloat16", device="cuda", weights="float", max_positions=256
    )
    operands = _prefill_batch(model, shape)
    assert model._prefill_fuses(operands[2], operands[1], None)
    cache = _assert_fused_matches_unfused(model, operands, "_plain_layers")
    assert not torch.equal(cache, operands[3])  # the step stored its keys and values


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_epilogues_step_matches_plain_step(tiny, rows, monkeypatch):
    """TRTEDGE_DECODE_EPILOGUES=1 with both epilogues forced (at start the timing may pick the
    separate kernels at these tiny shapes): qkv's q/k-norm + RoPE + KV store and gate_up's SiLU-mul
    give the plain step's output and cache."""
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    from trtedge.runtime.models.layers import GatedMLP
    from trtedge.runtime.ops import triton_gemv
    from trtedge.runtime.ops.triton_gemv import Fusion, _bucket

    monkeypatch.setenv("TRTEDGE_DECODE_EPILOGUES", "1")
    model = load_model(
        resolve_checkpoint(str(tiny)), dtype="bfloat16", device="cuda", weights="float", max_positions=256
    )
    assert model.decode_epilogues
    cfg = model.cfg
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    mlps = [layer.mlp for layer in model.layers if type(layer.mlp) is GatedMLP]
    for layer in model.layers:
        key = (*layer.qkv.weight.shape, _bucket(rows), Fusion(rope=heads))
        monkeypatch.setitem(triton_gemv._plans, key, (cfg.head_dim, 32, 1))
    for mlp in mlps:
        assert mlp.silu_epilogue
        key = (*mlp.gate_up.weight.shape, _bucket(rows), Fusion(silu_out=True))
        monkeypatch.setitem(triton_gemv._plans, key, (32, 32, 1))
    operands = _decode_batch(model, rows)
    out, cache = _step(model, *operands)
    model.decode_epilogues = False
    for mlp in mlps:
        mlp.silu_epilogue = False
    ref, ref_cache = _step(model, *operands)
    assert _rel(out, ref) < 2e-2
    assert _rel(cache, ref_cache) < 2e-2


def _rope_store_reference(qkv, heads, kv_heads, head_dim, positions, cos, sin, q_norm, k_norm, eps):
    """Per token and head: RMSNorm as HF rounds it (float32, to the dtype, times the weight, to the
    dtype), then the rotation in float32: (q, k, v) as [tokens, heads, head_dim] in the dtype."""
    dt, half = qkv.dtype, head_dim // 2
    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]

    def rotate(x, w):
        x = x.float()
        if w is not None:
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dt).float() * w.float()
            x = x.to(dt).float()
        a, b = x[..., :half], x[..., half:]
        return torch.cat(
            [a * c[..., :half] - b * s[..., :half], b * c[..., half:] + a * s[..., half:]], -1
        ).to(dt)

    return rotate(q, q_norm), rotate(k, k_norm), v


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (14, 2, 64), (6, 1, 32), (32, 8, 128)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_qkv_rope_store_matches_the_torch_reference(heads, kv_heads, head_dim, qk_norm, dtype, rows):
    from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

    gen = torch.Generator().manual_seed(rows + heads)
    like = dict(device="cuda", dtype=dtype)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(**like)
    cos = torch.randn(512, head_dim, generator=gen).to(**like)
    sin = torch.randn(512, head_dim, generator=gen).to(**like)
    q_norm, k_norm = (torch.rand(2, head_dim, generator=gen) + 0.5).to(**like) if qk_norm else (None, None)
    positions = torch.randint(0, 512, (rows,), generator=gen).cuda()
    slots = torch.randperm(512, generator=gen)[:rows].cuda()
    k_cache = torch.zeros(512, kv_heads, head_dim, **like)
    v_cache = torch.zeros_like(k_cache)
    q_out = torch.zeros(rows, heads, head_dim, **like)
    TritonDecodeKernels().qkv_rope_store(
        qkv,
        heads,
        kv_heads,
        head_dim,
        positions,
        cos,
        sin,
        q_norm,
        k_norm,
        1e-6,
        slots,
        k_cache,
        v_cache,
        q_out,
    )
    q_ref, k_ref, v_ref = _rope_store_reference(
        qkv, heads, kv_heads, head_dim, positions, cos, sin, q_norm, k_norm, 1e-6
    )
    # the kernel's float32 sums may be added in another order: within a rounding of the dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_cache[slots], k_ref, **tol)
    assert torch.equal(v_cache[slots], v_ref)
    untouched = torch.ones(512, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,hidden,qk_norm,bias",
    [(16, 8, 128, 1024, True, False), (32, 8, 64, 2048, False, False), (14, 2, 64, 896, False, True),
     (4, 4, 32, 64, True, True)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_qkv_epilogue_equals_product_then_rope_store(heads, kv_heads, head_dim, hidden, qk_norm, bias, rows):
    from trtedge.runtime.models.layers import rms_norm
    from trtedge.runtime.ops.triton_fused import TritonDecodeKernels
    from trtedge.runtime.ops.triton_gemv import Fusion, RopeStore, SkinnyLinear, candidates

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(heads + rows)
    like = dict(device="cuda", dtype=dtype)
    n = (heads + 2 * kv_heads) * head_dim
    w = (torch.randn(n, hidden, generator=gen) * hidden**-0.5).to(**like)
    lin = SkinnyLinear(w, torch.randn(n, generator=gen).to(**like) if bias else None)
    x = torch.randn(rows, hidden, generator=gen).to(**like)
    norm = (torch.rand(hidden, generator=gen) + 0.5).to(**like)
    cos = torch.randn(300, head_dim, generator=gen).to(**like)
    sin = torch.randn(300, head_dim, generator=gen).to(**like)
    q_norm, k_norm = (torch.rand(2, head_dim, generator=gen) + 0.5).to(**like) if qk_norm else (None, None)
    positions = torch.randint(0, 300, (rows,), generator=gen).cuda()
    slots = torch.randperm(64, generator=gen)[:rows].cuda()

    def outputs():
        return (
            torch.zeros(64, kv_heads, head_dim, **like),
            torch.zeros(64, kv_heads, head_dim, **like),
            torch.zeros(rows, heads, head_dim, **like),
        )

    k_ref, v_ref, q_ref = outputs()
    qkv = F.linear(rms_norm(x, norm, 1e-6), w, lin.bias)
    TritonDecodeKernels().qkv_rope_store(
        qkv, heads, kv_heads, head_dim, positions, cos, sin, q_norm, k_norm, 1e-6, slots, k_ref, v_ref, q_ref
    )
    fusion = Fusion(norm=True, rope=(heads, kv_heads, head_dim))
    for plan in candidates(n, hidden, fusion):
        lin._reserve(plan)
        k_out, v_out, q_out = outputs()
        store = RopeStore(
            heads, kv_heads, head_dim, positions, cos, sin, q_norm, k_norm, 1e-6, slots, k_out, v_out, q_out
        )
        for _ in range(2):
            lin.launch(x, plan, norm=norm, rope=store)
        for out, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):
            assert _rel(out, ref) < 1e-2, plan
    assert int(lin.counts.sum()) == 0
    k_out, v_out, q_out = outputs()
    store = RopeStore(
        heads, kv_heads, head_dim, positions, cos, sin, q_norm, k_norm, 1e-6, slots, k_out, v_out, q_out
    )
    lin.fused(x, norm=norm, eps=1e-6, rope=store)  # tunes
    eager = [t.clone() for t in (q_out, k_out, v_out)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lin.fused(x, norm=norm, eps=1e-6, rope=store)
    for t in (q_out, k_out, v_out):
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip((q_out, k_out, v_out), eager):
        assert torch.equal(out, ref)


@pytest.fixture
def pdl_on(monkeypatch):
    """PDL asked for (TRTEDGE_PDL=1) and probed again; the module's state restored after."""
    from trtedge.runtime.ops import pdl

    monkeypatch.setenv("TRTEDGE_PDL", "1")
    saved, pdl._enabled = pdl._enabled, None
    yield pdl
    pdl._enabled = saved


def test_pdl_is_on_for_hopper_when_asked(pdl_on):
    assert pdl_on.enabled() == (torch.cuda.get_device_capability() >= (9, 0))


def test_decode_step_graph_with_pdl_equals_eager_without(tmp_path, monkeypatch, pdl_on):
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    from trtedge.runtime.ops.attention import AttentionBatch

    pdl = pdl_on
    monkeypatch.setenv("TRTEDGE_DECODE_FUSION", "1")
    model = load_model(
        resolve_checkpoint(str(make_tiny_checkpoint(tmp_path, "qwen3"))),
        dtype="bfloat16",
        device="cuda",
        weights="float",
        max_positions=256,
    )
    cfg, block_size, rows = model.cfg, 4, 3
    kv = torch.randn(cfg.num_layers, 2, 32, block_size, cfg.num_kv_heads, cfg.head_dim, device="cuda")
    kv = kv.to(model.dtype)
    context_lens = [5, 17, 9]
    tables = [torch.tensor(t, device="cuda") for t in ([7, 3], [10, 11, 30, 2, 12], [20, 21, 22])]
    slots = [
        int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
        for t, c in zip(tables, context_lens)
    ]
    batch = AttentionBatch(torch.tensor(slots, device="cuda"), [1] * rows, context_lens, tables, block_size)
    batch.tables_tensor = batch.padded_block_tables()
    batch.context_lens_tensor = torch.tensor(context_lens, device="cuda")
    ids = torch.tensor([5, 9, 300], device="cuda")
    pos = torch.tensor([c - 1 for c in context_lens], device="cuda")
    caches = [kv.clone(), kv.clone()]

    def step(cache):
        return model.forward(ids, pos, [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)], batch)

    saved = pdl.enabled()
    assert saved
    try:
        pdl._enabled = False
        eager = step(caches[0]).clone()
        pdl._enabled = saved
        step(caches[1])  # warm-up (tunes nothing new: the plans are cached)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(caches[1])
        caches[1].copy_(kv)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        pdl._enabled = saved
    assert torch.equal(out, eager)
    assert torch.equal(caches[1], caches[0])


@pytest.mark.parametrize(
    "experts,top_k,hidden,inter,normalize",
    [(128, 8, 256, 96, True), (6, 2, 64, 48, False), (64, 4, 128, 200, True)],
)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("normed_input", [False, True])
def test_moe_decode_experts_match_grouped_reference(
    experts, top_k, hidden, inter, normalize, rows, normed_input
):
    """Both forms: RMSNorm(x) in and x += the MLP (the fused decode layer), or the normed rows in and
    the MLP's output stored apart (the unfused layer, SparseMoE's default for a few rows)."""
    from trtedge.runtime.models.layers import rms_norm
    from trtedge.runtime.ops.triton_moe import decode_experts, fused_experts

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(experts + rows)
    like = dict(device="cuda", dtype=dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(**like)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(**like)
    router = torch.randn(experts, hidden, generator=gen).to(**like)
    x = torch.randn(rows, hidden, generator=gen).to(**like)
    norm = (torch.rand(hidden, generator=gen) + 0.5).to(**like)
    h = rms_norm(x, norm, 1e-6)
    logits = F.linear(h, router)
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    mlp = fused_experts(h, w_gate_up, w_down, weights.to(dtype), ids, F.silu)
    if normed_input:
        out, captured = torch.empty_like(h), torch.zeros_like(h)
        decode_experts(h, None, 0.0, logits, w_gate_up, w_down, top_k, normalize, out=out)
        assert _rel(out, mlp) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_experts(h, None, 0.0, logits, w_gate_up, w_down, top_k, normalize, out=captured)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)
        return
    out = x.clone()
    decode_experts(out, norm, 1e-6, logits, w_gate_up, w_down, top_k, normalize)  # tunes, then runs
    assert _rel(out, x + mlp) < 1e-2
    captured = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_experts(captured, norm, 1e-6, logits, w_gate_up, w_down, top_k, normalize)
    captured.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
