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
