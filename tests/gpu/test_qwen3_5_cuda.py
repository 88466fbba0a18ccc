"""Qwen3.5 on CUDA: fla-core's gated delta rule kernels against the torch reference, and greedy
output against HF transformers on the GPU. Skips without CUDA or without the fla-core package."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_hybrid_checkpoint
from trtedge.runtime.ops import gated_delta as gd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or not gd.fla_available(torch.device("cuda")), reason="needs fla-core"
)


def random_inputs(t: int, h: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = gd.l2_normalize(torch.randn(t, h, dk, generator=g)) * dk**-0.5
    k = gd.l2_normalize(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay, beta = -torch.rand(t, h, generator=g) * 0.2, torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g) * 0.1
    return [x.cuda() for x in (q, k, v, decay, beta, state)]


@needs_fla
@pytest.mark.parametrize("t", [1, 37, 64, 200])
@pytest.mark.parametrize("h,dk,dv", [(4, 16, 16), (16, 128, 128)])
def test_fla_chunk_matches_the_torch_reference(t, h, dk, dv):
    q, k, v, decay, beta, state = random_inputs(t, h, dk, dv, seed=t)
    ref_out, ref_state = gd.chunk_gated_delta(q, k, v, decay, beta, state)
    out, final = gd.fla_chunk(q, k, v, decay, beta, state)
    assert torch.allclose(out.float(), ref_out, atol=2e-3, rtol=2e-3)
    assert torch.allclose(final, ref_state, atol=2e-3, rtol=2e-3)


@needs_fla
@pytest.mark.parametrize("h,dk,dv", [(4, 16, 16), (16, 128, 128)])
def test_fla_recurrent_matches_the_torch_reference(h, dk, dv):
    batch = 5
    q, k, v, decay, beta, _ = random_inputs(batch, h, dk, dv, seed=3)
    states = torch.randn(batch, h, dk, dv, device="cuda") * 0.1
    ref_out, ref_state = gd.recurrent_gated_delta(q, k, v, decay, beta, states)
    out, final = gd.fla_recurrent(q, k, v, decay, beta, states)
    assert torch.allclose(out.float(), ref_out, atol=2e-3, rtol=2e-3)
    assert torch.allclose(final, ref_state, atol=2e-3, rtol=2e-3)


def test_greedy_matches_transformers_on_the_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=True)
    # On the GPU: with fla-core installed HF's own layers call its Triton kernels, which need CUDA tensors.
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).cuda().eval()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 29)), [(i * 37) % 500 + 3 for i in range(150)]]
    with LLM(str(path), dtype="float32", device="cuda", max_kv_cache_capacity=512, max_input_len=256) as llm:
        got = [llm.generate(ids, params).token_ids for ids in prompts]
        batched = [o.token_ids for o in llm.generate(prompts, params)]
    for ids, out in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out], device="cuda")).logits[0].cpu()
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out
    assert batched == got


def test_speculative_and_jump_forward_restore_the_state_on_the_gpu(tmp_path):
    """Draft windows run fla's recurrent kernel token by token; rollback restores the kept states."""
    from tests.runtime.spec_helpers import repetitive_prompts
    from tests.runtime.test_qwen3_5_speculative import KnowingProposer
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.engine import Engine, EngineConfig
    from trtedge.runtime.models import load_model
    from trtedge.runtime.sampling_params import GuidedDecodingParams, SamplingParams
    from trtedge.runtime.speculative import SpeculativeConfig

    checkpoint = resolve_checkpoint(str(make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False)))
    model = load_model(checkpoint, dtype="float32", device="cuda", weights="auto", max_positions=512)
    tokenizer = checkpoint.load_tokenizer()
    prompts = repetitive_prompts(6)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def run(params, speculative=None, setup=None):
        config = EngineConfig(
            max_batch_size=6,
            max_kv_cache_capacity=256,
            enable_in_flight_batching=True,
            speculative=speculative,
        )
        engine = Engine(model, tokenizer, config)
        if setup is not None:
            setup(engine)
        try:
            outs = [[t for d in s for t in d.token_ids] for s in [engine.submit(p, params) for p in prompts]]
        finally:
            engine.shutdown()
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots
        return outs, engine

    plain, _ = run(greedy)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    knowing = KnowingProposer(prompts, plain)
    outs, engine = run(greedy, spec, lambda e: setattr(e.speculative, "proposer", knowing))
    assert outs == plain
    assert 0 < engine.speculative.stats.accepted_tokens < engine.speculative.stats.draft_tokens
    outs, _ = run(greedy, spec)
    assert outs == plain

    def jump(engine):
        def propose(seq):
            limit = min(4, seq.params.max_tokens - seq.num_output_tokens - 1)
            [draft] = knowing.propose([seq], [limit]) if limit > 0 else [None]
            if draft is not None:
                seq.token_ids.extend(draft.tokens)
                seq.num_draft_tokens = len(draft)

        engine.guides.propose = propose

    guide = GuidedDecodingParams(regex="(w[0-9]+)*", jump_forward=True)
    guided = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, guided_decoding=guide)
    outs, _ = run(guided, setup=jump)
    assert outs == plain


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_moe_greedy_matches_transformers_on_the_gpu(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    path = make_tiny_hybrid_checkpoint(tmp_path / "m", vision=False, moe=True, family=family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 29)), [(i * 37) % 500 + 3 for i in range(150)]]
    with LLM(str(path), dtype="float32", device="cuda", max_kv_cache_capacity=512, max_input_len=256) as llm:
        got = [llm.generate(ids, params).token_ids for ids in prompts]
    for ids, out in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out], device="cuda")).logits[0].cpu()
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out


def test_fused_experts_on_the_gpu_match_the_per_expert_checkpoint(tmp_path):
    """The grouped Triton MoE kernel takes fused expert tensors (experts.gate_up_proj) as loaded."""
    from tests.runtime.test_moe_fused_experts import fuse_experts
    from trtedge import LLM, SamplingParams

    per_expert = make_tiny_hybrid_checkpoint(tmp_path / "split", vision=False, moe=True)
    fused = fuse_experts(per_expert, tmp_path / "fused")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = []
    for path in (per_expert, fused):
        with LLM(str(path), dtype="float32", device="cuda", max_kv_cache_capacity=256) as llm:
            outs.append(llm.generate(list(range(5, 29)), params).token_ids)
    assert len(outs[0]) == 32 and outs[0] == outs[1]
