"""A GGUF file whose Q4_K / Q6_K / Q8_0 blocks a CPU bundle keeps as they are, launched on CUDA: the
kept blocks have no GPU kernel, so they run dequantized (--weights auto) or requantized to the GPU's
int4 / int8 (--weights int4), and greedy output equals the file dequantized to float32 on the CPU.
Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cpu_scale import Geometry, write_gguf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_LLAMA = Geometry("tiny", "llama", 256, 512, 2, 4, 2, 1000, False, False, 10000.0)


def test_a_q4_k_m_file_runs_on_cuda_with_kept_blocks_in_the_bundle(tmp_path):
    from trtedge import LLM, SamplingParams

    path = tmp_path / "tiny-q4_k_m.gguf"
    write_gguf(path, TINY_LLAMA, "q4_k_m")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]
    outs = {}
    for device, weights in (("cpu", "fp32"), ("cuda", "auto"), ("cuda", "int4")):
        with LLM(
            str(path), device=device, dtype="float32", weights=weights, cache_dir=str(tmp_path / "cache"),
            max_kv_cache_capacity=256,
        ) as llm:  # fmt: skip
            outs[device, weights] = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert len(outs["cuda", "auto"]) == 8
    assert outs["cuda", "auto"] == outs["cpu", "fp32"]  # dequantized: the same float32 weights
    assert len(outs["cuda", "int4"]) == 8  # requantized: runs (its tokens may differ)
