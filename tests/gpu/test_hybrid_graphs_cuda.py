"""Decode CUDA graphs over hybrid models' recurrent layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
Nemotron-H): greedy output with the graphs equals eager and HF transformers in float32, batched equals
alone, and preemption, context reuse (checkpoints taken inside graphed decode steps) and speculative
verification (verify chains inside the graphs) keep it; every KV block and state slot is freed. The
chained recurrent kernels equal their token-by-token torch reference. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_hybrid_checkpoint, make_tiny_nemotron_h_checkpoint
from trtedge import LLM, ContextCacheConfig, SamplingParams
from trtedge.runtime.engine import Engine, EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
# nemotron_h routes within 2 expert groups (the torch router); nemotron_h_one_group, as Nemotron-3-Nano
# does, through the one-launch router kernel
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_one_group"]


def checkpoint(family: str, directory):
    if family == "nemotron_h":
        return make_tiny_nemotron_h_checkpoint(directory)
    if family == "nemotron_h_one_group":
        return make_tiny_nemotron_h_checkpoint(directory, n_group=1)
    return make_tiny_hybrid_checkpoint(
        directory, vision=False, moe=family != "qwen3_5", family=family.removesuffix("_moe")
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(24, 1), prompt(150, 2), prompt(7, 3), prompt(40, 4), prompt(61, 5)]


def hybrid_llm(path, eager: bool, **options) -> LLM:
    defaults = dict(
        dtype="float32",
        device="cuda",
        max_kv_cache_capacity=512,
        max_input_len=256,
        max_batch_size=4,
        enable_in_flight_batching=True,
        engine_process=False,  # the test reads the runner's graphs and pools
        enforce_eager=eager,
    )
    return LLM(str(path), **{**defaults, **options})


def run(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], list[list[int]]]:
    """(each prompt alone, all of them batched); asserts the pools end empty."""
    alone = [llm.generate(p, params).token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats()
    assert stats["state_slots_free"] == stats["state_slots_total"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return alone, batched


@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_greedy_equals_eager_and_transformers(family, tmp_path):
    pytest.importorskip("transformers")
    path = checkpoint(family, tmp_path / "m")
    with hybrid_llm(path, eager=False) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.states is llm.engine.runner.states
        alone, batched = run(llm, PROMPTS)
        assert graphs.num_replays >= len(PROMPTS) * (GREEDY.max_tokens - 1)
    with hybrid_llm(path, eager=True) as llm:
        assert llm.engine.runner.graphs is None
        eager_alone, eager_batched = run(llm, PROMPTS)
    assert alone == eager_alone
    assert batched == alone and eager_batched == eager_alone
    assert _transformers_argmax(path, PROMPTS, alone) == alone


# transformers' own torch path, in float32 on the CPU: with fla-core importable, HF's Qwen3-Next runs
# fla's Triton kernels instead, whose roundings part from it (at token 10 of one prompt on the H200;
# trtedge equalled the torch path on every prompt there)
_REFERENCE = """
import json, sys
sys.modules["fla"] = None
import torch, transformers
path, rows = json.loads(sys.stdin.read())
hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
picks = []
with torch.no_grad():
    for ids, out in rows:
        logits = hf(torch.tensor([ids + out])).logits[0]
        picks.append(logits[len(ids) - 1 : -1].argmax(-1).tolist())
print(json.dumps(picks))
"""


def _transformers_argmax(path, prompts, outputs) -> list[list[int]]:
    """HF's greedy pick at each generated position of each (prompt, output), by the reference above."""
    import json
    import subprocess
    import sys

    rows = [[p, o] for p, o in zip(prompts, outputs)]
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE], input=json.dumps([str(path), rows]), capture_output=True,
        text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_graphed_decode_survives_preemption(family, tmp_path):
    path = checkpoint(family, tmp_path / "m")
    prompts = [prompt(20, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with hybrid_llm(path, eager=False, max_batch_size=1) as llm:
        expected = [llm.generate(p, params).token_ids for p in prompts]
        # 6 blocks of 16 tokens for 4 seats of up to 60 tokens: the scheduler must preempt
        config = EngineConfig(
            max_batch_size=4, max_kv_cache_capacity=64, enable_in_flight_batching=True, num_blocks=6
        )
        engine = Engine(llm.model, llm.tokenizer, config)
    try:
        assert engine.runner.graphs is not None
        outs = [[t for d in s for t in d.token_ids] for s in [engine.submit(p, params) for p in prompts]]
        assert engine.stats.preemptions > 0
        assert engine.runner.graphs.num_replays > 0
        assert engine.blocks.state.num_free_slots == 4 and engine.blocks.num_free_blocks == 6
    finally:
        engine.shutdown()
    assert outs == expected


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_a_checkpoint_saved_by_a_graphed_decode_step_resumes_the_next_turn(family, tmp_path):
    """The first turn's generated tokens cross block ends in graphed decode steps; the second turn
    reuses a prefix past the first prompt, so its state comes from one of those checkpoints."""
    path = checkpoint(family, tmp_path / "m")
    first_prompt = prompt(40, 9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reuse = ContextCacheConfig(enabled=True)
    with hybrid_llm(path, eager=False, context_cache_config=reuse) as warm:
        first = warm.generate(first_prompt, params)
        second_prompt = first_prompt + first.token_ids + prompt(5, 10)
        second = warm.generate(second_prompt, params)
        assert warm.engine.runner.graphs.num_replays > 0
    with hybrid_llm(path, eager=True) as cold:
        reference = cold.generate(second_prompt, params).token_ids
    assert second.metrics.reused_tokens > len(first_prompt)
    assert second.token_ids == reference


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def repetitive(family: str, directory):
    """(checkpoint, prompts that n-gram lookup drafts for, their eager plain greedy output)."""
    from tests.runtime.spec_helpers import repetitive_prompts

    path = checkpoint(family, directory)
    prompts = repetitive_prompts(4)
    with hybrid_llm(path, eager=True) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    return path, prompts, plain


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_ngram_speculation_verifies_inside_the_decode_graphs(family, tmp_path):
    """Verify chains replay the captured decode step (the chained recurrent kernels): greedy output
    equals eager plain decoding, every verify step ran in a graph, no state slot leaks."""
    path, prompts, plain = repetitive(family, tmp_path / "m")
    with hybrid_llm(path, eager=False, speculative_config=NGRAM) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.speculative_metrics()["steps"] > 0
        decoder = llm.engine.speculative
        assert decoder.graph_verify and decoder.graph_steps == decoder.verify_steps > 0
        stats = llm.stats()
        assert stats["state_slots_free"] == stats["state_slots_total"]
    assert outs == plain


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_graphed_verify_chains_restore_the_state_of_every_accepted_length(family, tmp_path):
    """A proposer that drafts the true continuation with one wrong token at a rotating place: every
    accepted length 0..k restores the state its chain kept, alone and batched."""
    from tests.runtime.test_qwen3_5_speculative import KnowingProposer

    path, prompts, plain = repetitive(family, tmp_path / "m")
    with hybrid_llm(path, eager=False, speculative_config=NGRAM) as llm:
        decoder = llm.engine.speculative
        decoder.proposer = KnowingProposer(prompts, plain)
        alone = [llm.generate(p, GREEDY).token_ids for p in prompts]
        batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert decoder.graph_steps == decoder.verify_steps > 0
        assert 0 < decoder.stats.accepted_tokens < decoder.stats.draft_tokens
    assert alone == plain and batched == plain


def test_bfloat16_graphs_track_eager(tmp_path):
    """bf16 (the CUDA default): graphed and eager decode run the same kernels on the same inputs."""
    path = checkpoint("qwen3_5", tmp_path / "m")
    outs = []
    for eager in (False, True):
        with hybrid_llm(path, eager=eager, dtype="bfloat16") as llm:
            outs.append(run(llm, PROMPTS[:3]))
    assert outs[0] == outs[1]


def _randn(generator, *shape, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conv_step_kernel_shifts_the_state_in_place_at_the_rows(dtype):
    from trtedge.runtime.ops import gated_delta as gd
    from trtedge.runtime.ops import triton_recurrent as tr

    g = torch.Generator().manual_seed(0)
    x = _randn(g, 3, 300)[:, :264].to(dtype)  # a strided view, as split from the input projection
    states, weight, bias = (
        _randn(g, 6, 3, 264).to(dtype),
        _randn(g, 264, 4).to(dtype),
        _randn(g, 264).to(dtype),
    )
    rows = torch.tensor([4, 1, 5], device="cuda")
    ref_out, ref_state = gd.causal_conv_step(x.float(), states[rows].float(), weight.float(), bias.float())
    pool = states.clone()
    out = tr.conv_step(x, pool, rows, weight, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out, ref_out, atol=tol, rtol=tol)
    assert torch.equal(pool[rows], ref_state.to(dtype))
    assert torch.equal(pool[[0, 2, 3]], states[[0, 2, 3]])


def test_the_gated_delta_and_gated_norm_kernels_match_the_torch_reference():
    import torch.nn.functional as F

    from trtedge.runtime.ops import gated_delta as gd
    from trtedge.runtime.ops import triton_recurrent as tr

    g = torch.Generator().manual_seed(1)
    b, hk, hv, dk, dv = 3, 4, 8, 128, 128
    qkv = _randn(g, b, 2 * hk * dk + hv * dv)
    proj = _randn(g, b, 2 * hv + 5)
    beta_in, a_in = proj[:, 2 : 2 + hv], proj[:, 2 + hv : 2 + 2 * hv]
    a_exp, dt_bias = _randn(g, hv).abs(), _randn(g, hv)
    states = _randn(g, 6, hv, dk, dv, scale=0.1)
    rows = torch.tensor([5, 0, 2], device="cuda")
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
    q = gd.repeat_heads(gd.l2_normalize(q.unflatten(-1, (hk, dk))) * dk**-0.5, hv // hk)
    k = gd.repeat_heads(gd.l2_normalize(k.unflatten(-1, (hk, dk))), hv // hk)
    decay = -a_exp * F.softplus(a_in + dt_bias)
    ref_out, ref_state = gd.recurrent_gated_delta(
        q, k, v.unflatten(-1, (hv, dv)), decay, beta_in.sigmoid(), states[rows]
    )
    pool = states.clone()
    out = tr.gated_delta_step(qkv, a_in, beta_in, a_exp, dt_bias, pool, rows, hk)
    assert torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool[rows], ref_state, atol=1e-5, rtol=1e-5)
    z, w = _randn(g, b, hv * dv + 7)[:, : hv * dv], _randn(g, dv)
    ref = (F.rms_norm(out, (dv,), None, 1e-6) * w * F.silu(z.view(b, hv, dv))).reshape(b, -1)
    normed = tr.gated_norm(out.view(b, -1), z, w, 1e-6, hv, False, torch.float32)
    assert torch.allclose(normed, ref, atol=1e-5, rtol=1e-5)


def test_the_ssm_step_kernel_matches_the_torch_reference():
    import torch.nn.functional as F

    from trtedge.runtime.ops import gated_delta as gd
    from trtedge.runtime.ops import ssd
    from trtedge.runtime.ops import triton_recurrent as tr

    g = torch.Generator().manual_seed(2)
    b, h, p, n, groups = 3, 16, 64, 128, 4
    xbc = _randn(g, b, h * p + 2 * groups * n)
    dt_in = _randn(g, b, h + 9)[:, 3 : 3 + h]
    dt_bias, a, d = _randn(g, h), -_randn(g, h).abs() - 0.1, _randn(g, h)
    states = _randn(g, 5, h, p, n, scale=0.1)
    rows = torch.tensor([1, 4, 3], device="cuda")
    xs, bb, cc = xbc.split([h * p, groups * n, groups * n], -1)
    bb, cc = (gd.repeat_heads(t.reshape(b, groups, n), h // groups) for t in (bb, cc))
    dt = F.softplus(dt_in + dt_bias).clamp(min=0.001)
    ref_y, ref_state = ssd.recurrent_step(xs.reshape(b, h, p), dt, a, bb, cc, states[rows])
    pool = states.clone()
    y = tr.ssm_step(xbc, dt_in, dt_bias, a, d, 0.001, pool, rows, groups)
    assert torch.allclose(y, ref_y + d[:, None] * xs.reshape(b, h, p), atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool[rows], ref_state, atol=1e-5, rtol=1e-5)
    z, w = _randn(g, b, h * p), _randn(g, h * p)
    ref = F.rms_norm((y.reshape(b, -1) * F.silu(z)).view(b, groups, -1), (h * p // groups,), None, 1e-5)
    normed = tr.gated_norm(y.reshape(b, -1), z, w, 1e-5, groups, True, torch.float32)
    assert torch.allclose(normed, ref.reshape(b, -1) * w, atol=1e-5, rtol=1e-5)


def _gaps(logits: torch.Tensor, chosen: list[int]) -> list[float]:
    """Per row, how far the chosen token's logit is below the row's best, as a share of the row's
    spread: 0 where the choice is the float32 argmax, small where bf16 broke a near tie."""
    best, worst = logits.max(-1).values, logits.min(-1).values
    picked = logits[torch.arange(len(chosen)), torch.tensor(chosen)]
    return ((best - picked) / (best - worst)).tolist()


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_bfloat16_graphed_decode_tracks_float32_transformers(family, fusion, tmp_path, monkeypatch):
    """bf16 decode steps (the fused recurrent kernels; with TRTEDGE_DECODE_FUSION=1 also the products
    that take the norms, SiLU-mul and residual adds) against HF in float32: 32 greedy tokens that are
    the float32 argmax or within 3% of the logit spread of it."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TRTEDGE_DECODE_FUSION", fusion)
    path = checkpoint(family, tmp_path / "m")
    ids = PROMPTS[3]
    with hybrid_llm(path, eager=False, dtype="bfloat16") as llm:
        assert llm.model.fused_products == (fusion == "1")
        out = llm.generate(ids, GREEDY).token_ids
        assert llm.engine.runner.graphs.num_replays >= GREEDY.max_tokens - 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out], device="cuda")).logits[0].float().cpu()
    gaps = _gaps(logits[len(ids) - 1 : -1], out)
    assert max(gaps) <= 0.03, gaps
    assert sum(g == 0 for g in gaps) >= 24, gaps


def test_the_decode_router_and_pair_products_match_the_per_expert_reference():
    """Nemotron-3-Nano's routing (128 experts, top-6, one group) and its experts (squared ReLU)."""
    import torch.nn.functional as F

    from trtedge.runtime.ops import triton_moe_decode as md

    g = torch.Generator().manual_seed(3)
    t, k, e, top, inter = 5, 256, 128, 6, 96
    h = _randn(g, t, k)
    router, bias = _randn(g, e, k, scale=0.1), _randn(g, e, scale=0.1)
    weights, ids = md.sigmoid_route(h, router, bias, top, True, 2.5)
    scores = F.linear(h, router).sigmoid()
    want = (scores + bias).topk(top, dim=-1).indices
    assert torch.equal(ids, want)
    ref_w = scores.gather(1, want)
    assert torch.allclose(weights, ref_w / ref_w.sum(-1, keepdim=True) * 2.5, atol=1e-6)
    w_up, w_down = _randn(g, e, inter, k, scale=0.1), _randn(g, e, k, inter, scale=0.1)
    up = md.pair_gemv(h, w_up, ids, top)
    y = md.pair_gemv(up, w_down, ids, 1, scale=weights.flatten(), relu2_in=True).view(t, top, -1).sum(1)
    ref = torch.zeros_like(y)
    for row in range(t):
        for j in range(top):
            expert = ids[row, j]
            act = F.relu(F.linear(h[row], w_up[expert])).square()
            ref[row] += F.linear(act, w_down[expert]) * weights[row, j]
    assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_qk_norm_rope_kernel_matches_the_gated_attention_reference(dtype):
    from trtedge.runtime.models.layers import rotate
    from trtedge.runtime.models.qwen3_5 import rms_norm
    from trtedge.runtime.ops import triton_qk_norm

    g = torch.Generator().manual_seed(4)
    t, h, kv, d, rd = 3, 16, 4, 256, 64  # the ~9B shape's heads: partial rotary on a quarter
    qkv = _randn(g, t, 2 * h * d + 2 * kv * d + 8)[:, : 2 * h * d + 2 * kv * d].to(dtype)
    cos, sin = _randn(g, t, 1, rd).to(dtype), _randn(g, t, 1, rd).to(dtype)
    q_norm, k_norm = 1 + _randn(g, d, scale=0.1), 1 + _randn(g, d, scale=0.1)
    qg, k, _ = qkv.split([2 * h * d, kv * d, kv * d], dim=-1)
    q = rms_norm(qg.reshape(t, h, 2 * d)[..., :d], q_norm, 1e-6)
    k = rms_norm(k.reshape(t, kv, d), k_norm, 1e-6)
    q = torch.cat([rotate(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)
    k = torch.cat([rotate(k[..., :rd], cos, sin), k[..., rd:]], dim=-1)
    got_q, got_k = triton_qk_norm.qk_norm_rope(qkv, cos, sin, q_norm, k_norm, 1e-6, h, kv, d)
    tol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: a rounding of 1/rms apart at most
    assert torch.allclose(got_q.float(), q.float(), atol=tol, rtol=tol)
    assert torch.allclose(got_k.float(), k.float(), atol=tol, rtol=tol)


# A verify step inside the decode graphs: rows are chains (consecutive rows of one sequence, each after
# the one before), lengths [3, 1, 2] here, a 0 at a chain's later rows; a chain's recurrent state comes
# from its sequence's live row, and the state after every row is kept in the scratch rows (-1: none).
# The last two rows are a captured step's padding: chains of one on the pool's padding row (1 here),
# whose outputs and state are scratch (not compared).
CHAIN_LENS = [3, 0, 0, 1, 2, 0, 1, 1]
CHAIN_SAVES = [2, 0, 1, -1, 4, 3, -1, -1]
CHAIN_ROWS = [5, 5, 5, 0, 2, 2, 1, 1]
REAL, PAD_ROW = 6, 1  # rows before the padding; the padding rows' state row


def _chain_reference(step, rows, *state_lists):
    """Run ``step(i, states) -> (out_i, new states)`` row by row from the live rows, as the eager
    verify does; returns the outputs, the live states after and the states kept per row."""
    outs, kept = [], {}
    live = [s.clone() for s in state_lists]
    for i, row in enumerate(rows):
        out, new = step(i, [s[row : row + 1] for s in live])
        for s, n in zip(live, new):
            s[row] = n[0]
        outs.append(out)
        kept[i] = [n[0].clone() for n in new]
    return torch.cat(outs), live, kept


def _chains(device, conv_scratch, ssm_scratch):
    from trtedge.runtime.executor.state_pool import Chains

    def t(values):
        return torch.tensor(values, device=device)

    return Chains(t(CHAIN_LENS), t(CHAIN_SAVES), conv_scratch, ssm_scratch), t(CHAIN_ROWS)


def check_chained_recurrent_kernels(device="cuda", dtype=torch.float32) -> None:
    """The conv, gated-delta and SSM kernels over chains equal the token-by-token torch reference:
    outputs, the live states after each chain, every kept state; untouched rows stay as they were."""
    import torch.nn.functional as F

    from trtedge.runtime.ops import gated_delta as gd
    from trtedge.runtime.ops import ssd
    from trtedge.runtime.ops import triton_recurrent as tr

    g = torch.Generator().manual_seed(3)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    b = len(CHAIN_ROWS)
    saved = [i for i, s in enumerate(CHAIN_SAVES) if s >= 0]
    live_rows = [r for r in range(6) if r != PAD_ROW]
    # conv
    c = 200
    x = randn(b, c + 20)[:, :c].to(dtype)  # a strided view, as split from the input projection
    conv_states, weight, bias = randn(6, 3, c).to(dtype), randn(c, 4).to(dtype), randn(c).to(dtype)
    scratch = torch.full((6, 3, c), 7.0, device=device, dtype=dtype)
    chains, rows = _chains(device, scratch, None)

    def conv_ref(i, states):
        out, new = gd.causal_conv_step(x[i : i + 1].float(), states[0].float(), weight.float(), bias.float())
        return out, [new.to(dtype)]

    ref_out, (ref_live,), kept = _chain_reference(conv_ref, CHAIN_ROWS, conv_states)
    pool = conv_states.clone()
    out = tr.conv_step(x, pool, rows, weight, bias, chain=chains)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[:REAL], ref_out[:REAL], atol=tol, rtol=tol)
    assert torch.equal(pool[live_rows], ref_live[live_rows])
    for i in saved:
        assert torch.equal(scratch[CHAIN_SAVES[i]], kept[i][0]), i
    assert torch.equal(scratch[5], torch.full((3, c), 7.0, device=device))  # no row keeps its state there
    # gated delta (Qwen3.5)
    hk, hv, dk, dv = 2, 4, 32, 64
    qkv = randn(b, 2 * hk * dk + hv * dv)
    proj = randn(b, 2 * hv + 3)
    beta_in, a_in = proj[:, 1 : 1 + hv], proj[:, 1 + hv : 1 + 2 * hv]
    a_exp, dt_bias = randn(hv).abs(), randn(hv)
    ssm_states = randn(6, hv, dk, dv, scale=0.1)
    scratch = torch.zeros(5, hv, dk, dv, device=device)
    chains, rows = _chains(device, None, scratch)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
    q = gd.repeat_heads(gd.l2_normalize(q.unflatten(-1, (hk, dk))) * dk**-0.5, hv // hk)
    k = gd.repeat_heads(gd.l2_normalize(k.unflatten(-1, (hk, dk))), hv // hk)
    v = v.unflatten(-1, (hv, dv))
    decay, beta = -a_exp * F.softplus(a_in + dt_bias), beta_in.sigmoid()

    def delta_ref(i, states):
        s = slice(i, i + 1)
        out, new = gd.recurrent_gated_delta(q[s], k[s], v[s], decay[s], beta[s], states[0])
        return out, [new]

    ref_out, (ref_live,), kept = _chain_reference(delta_ref, CHAIN_ROWS, ssm_states)
    pool = ssm_states.clone()
    out = tr.gated_delta_step(qkv, a_in, beta_in, a_exp, dt_bias, pool, rows, hk, chain=chains)
    assert torch.allclose(out[:REAL], ref_out[:REAL], atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool[live_rows], ref_live[live_rows], atol=1e-5, rtol=1e-5)
    for i in saved:
        assert torch.allclose(scratch[CHAIN_SAVES[i]], kept[i][0], atol=1e-5, rtol=1e-5), i
    # SSM (Nemotron-H's Mamba-2)
    h, p, n, groups = 4, 16, 32, 2
    xbc = randn(b, h * p + 2 * groups * n)
    dt_in = randn(b, h + 3)[:, 1 : 1 + h]
    dt_bias, a, d = randn(h), -randn(h).abs() - 0.1, randn(h)
    ssm_states = randn(6, h, p, n, scale=0.1)
    scratch = torch.zeros(5, h, p, n, device=device)
    chains, rows = _chains(device, None, scratch)
    xs, bb, cc = xbc.split([h * p, groups * n, groups * n], -1)
    xs = xs.reshape(b, h, p)
    bb, cc = (gd.repeat_heads(t.reshape(b, groups, n), h // groups) for t in (bb, cc))
    dt = F.softplus(dt_in + dt_bias).clamp(min=0.001)

    def ssm_ref(i, states):
        s = slice(i, i + 1)
        y, new = ssd.recurrent_step(xs[s], dt[s], a, bb[s], cc[s], states[0])
        return y + d[:, None] * xs[s], [new]

    ref_out, (ref_live,), kept = _chain_reference(ssm_ref, CHAIN_ROWS, ssm_states)
    pool = ssm_states.clone()
    y = tr.ssm_step(xbc, dt_in, dt_bias, a, d, 0.001, pool, rows, groups, chain=chains)
    assert torch.allclose(y[:REAL], ref_out[:REAL], atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool[live_rows], ref_live[live_rows], atol=1e-5, rtol=1e-5)
    for i in saved:
        assert torch.allclose(scratch[CHAIN_SAVES[i]], kept[i][0], atol=1e-5, rtol=1e-5), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_recurrent_kernels_run_verify_chains_as_the_token_by_token_reference(dtype):
    check_chained_recurrent_kernels(dtype=dtype)
