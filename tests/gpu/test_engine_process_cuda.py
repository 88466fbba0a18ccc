"""The engine core in its own process, the CUDA default: the same greedy tokens, seeded samples and
logprobs as in-process, over a batch that joins mid-flight; a cancelled stream frees its seat and
blocks. Skips cleanly on machines without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from tests.tiny import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "qwen3")


def cuda_llm(path, process):
    from trtedge import LLM

    return LLM(
        str(path),
        dtype="float32",
        device="cuda",
        max_kv_cache_capacity=512,
        max_input_len=256,
        max_batch_size=8,
        enable_in_flight_batching=True,
        engine_process=process,
    )


def test_outputs_equal_in_process_and_cancel_frees_everything(tiny):
    from trtedge import SamplingParams

    prompts = [[3 + i, 17, 29 + 2 * i] * (2 + i) for i in range(8)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    runs = {}
    for process in (False, True):
        with cuda_llm(tiny, process) as llm:
            assert llm.engine_process is process and llm.describe()["engine_process"] is process
            a, b = llm.generate(prompts, greedy), llm.generate(prompts, seeded)
            runs[process] = ([o.token_ids for o in a], [o.token_ids for o in b], [o.logprobs for o in a])
            stream = llm.generate_stream(prompts[0], SamplingParams(max_tokens=400, ignore_eos=True))
            for n, _ in enumerate(stream):
                if n == 2:
                    stream.cancel()
            for _ in range(100):
                stats = llm.stats()
                if stats["active_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                    break
                time.sleep(0.05)
            assert stats["active_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    for x, y in zip(runs[True][2], runs[False][2]):
        assert [t.token_id for t in x] == [t.token_id for t in y]
        assert [t.logprob for t in x] == pytest.approx([t.logprob for t in y], abs=1e-4)
