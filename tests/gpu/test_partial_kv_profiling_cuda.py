"""On CUDA: partial-block KV snapshots are copied on the device and keep greedy output identical to
no reuse (CUDA graphs on); profiling times device stages with CUDA events."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama") / "m", "llama")


def _llm(path, **options):
    from trtedge import LLM

    # float32 and the same batch shape with and without reuse: only the reuse differs
    options = {"enable_in_flight_batching": True, "max_batch_size": 4, **options}
    return LLM(
        str(path), dtype="float32", device="cuda", max_kv_cache_capacity=256, max_input_len=128, **options
    )


def test_partial_kv_snapshots_keep_greedy_output_on_cuda(tiny):
    from trtedge import ContextCacheConfig, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    system = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [system + [40 + i, 41 + i] for i in range(3)]
    with _llm(tiny) as llm:
        cold = [o.token_ids for o in llm.generate(prompts, params)]
    reuse = ContextCacheConfig(enabled=True, partial_kv_snapshot_pool_bytes=1 << 20)
    with _llm(tiny, context_cache_config=reuse) as llm:
        llm.generate(system + [7], params)
        # overwrite the freed blocks: the reuse must come from the snapshot
        llm.generate(list(range(300, 360)), SamplingParams(max_tokens=2, temperature=0, reuse_context=False))
        warm = llm.generate(prompts, params)
        metrics = llm.get_context_cache_metrics()
    assert [o.metrics.reused_tokens for o in warm] == [37] * 3
    assert [o.token_ids for o in warm] == cold
    assert metrics.partial_kv_reused_tokens == 3 * 5


def test_profiling_times_device_stages_with_cuda_events(tiny):
    from trtedge import SamplingParams

    with _llm(tiny, enable_in_flight_batching=False) as llm:
        llm.set_profiling_enabled(True)
        out = llm.generate(list(range(5, 45)), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        metrics = llm.get_profiling_metrics()
    assert metrics.timer == "cuda_events"
    assert metrics.generation.generated_tokens == len(out.token_ids) == 16
    assert metrics.stages["llm_prefill"].runs == 1 and metrics.stages["llm_generation"].runs == 15
    assert metrics.stages["llm_generation"].total_time > 0
