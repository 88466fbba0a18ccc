"""Nemotron-H on CUDA: the Mamba-2 scan on the device against the CPU reference, and greedy output
against HF transformers on the GPU (attention through the Triton kernels). Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_nemotron_h_checkpoint
from trtedge.runtime.ops import ssd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("t", [1, 37, 128, 300])
def test_chunked_scan_on_the_device_matches_the_cpu(t):
    g = torch.Generator().manual_seed(t)
    h, p, n = 8, 64, 128
    x, b, c = (torch.randn(t, h, d, generator=g) for d in (p, n, n))
    dt, a = torch.rand(t, h, generator=g) * 0.1, -torch.rand(h, generator=g) - 0.1
    state = torch.randn(h, p, n, generator=g) * 0.1
    ref_out, ref_state = ssd.chunk_scan(x, dt, a, b, c, state, chunk=128)
    out, final = ssd.chunk_scan(*(v.cuda() for v in (x, dt, a, b, c, state)), chunk=128)
    assert torch.allclose(out.cpu(), ref_out, atol=2e-3, rtol=2e-3)
    assert torch.allclose(final.cpu(), ref_state, atol=2e-3, rtol=2e-3)


def test_greedy_matches_transformers_on_the_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 29)), [(i * 37) % 500 + 3 for i in range(150)]]
    with LLM(str(path), dtype="float32", device="cuda", max_kv_cache_capacity=512, max_input_len=256) as llm:
        got = [llm.generate(ids, params).token_ids for ids in prompts]
        batched = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    for ids, out in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out], device="cuda")).logits[0].cpu()
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out
    assert batched == got


def test_bfloat16_runs_and_frees_its_state_slots(tmp_path):
    """bf16 (the CUDA default): conv and norm weights in bf16, the scan and its state in float32."""
    from trtedge import LLM, SamplingParams

    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", device="cuda", max_kv_cache_capacity=256, max_input_len=128) as llm:
        outs = [o.token_ids for o in llm.generate([list(range(5, 45)), list(range(7, 30))], params)]
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    assert [len(o) for o in outs] == [8, 8]


def _gaps(logits: torch.Tensor, chosen: list[int]) -> list[float]:
    """For each row, how far the chosen token's logit is below the row's best, as a share of the row's
    spread: 0 where the choice is the float32 argmax, small where bf16 broke a near tie."""
    rows = logits.float()
    best, worst = rows.max(-1).values, rows.min(-1).values
    picked = rows[torch.arange(len(chosen)), torch.tensor(chosen)]
    return ((best - picked) / (best - worst)).tolist()


def test_bfloat16_tracks_the_float32_reference(tmp_path, device="cuda"):
    """bf16 on the device against HF in float32: the prompt's log-probabilities through three scan
    chunks, and 32 greedy tokens that are the float32 argmax or within 2% of the logit spread of it."""
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM, SamplingParams

    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = [(i * 37) % 500 + 3 for i in range(48)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(path), dtype="bfloat16", device=device, max_kv_cache_capacity=256, max_input_len=128) as llm:
        out = llm.generate(ids, params)
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids], device=device)).logits[0].float().cpu()
    ref = torch.log_softmax(logits, -1)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    err = (got - want).abs()
    assert err.max() < 0.15 and err.mean() < 0.03, (err.max(), err.mean())
    gaps = _gaps(logits[len(ids) - 1 : -1], out.token_ids)
    assert max(gaps) <= 0.02, gaps
    assert sum(g == 0 for g in gaps) >= 24, gaps  # most steps pick the float32 argmax itself
