"""The tensor-parallel machinery on one GPU: a one-rank NCCL group, so that the all-reduces and the
logits' all-gather are real NCCL calls, captured inside the decode CUDA graphs. The graph's logits and
the eager step's equal those of the same model without a group. (TP=2 and TP=4 need several GPUs:
test_tensor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.executor.runner import ModelRunner
from trtedge.runtime.models import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [1, 5, 9, 33, 200, 7, 8]
LOAD = dict(dtype="float32", device="cuda", weights="auto", max_positions=256, load_format="auto")


def _prefill_then_decode(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill logits, then the next token's logits through the graphs and eagerly (KV block 0)."""
    n = len(PROMPT)
    first, _ = runner.forward(PROMPT, list(range(n)), list(range(n)), [n], [n], [[0]], [n - 1])
    token = int(first.argmax(dim=-1)[0])
    graph = runner.graph_logits([token], [n], [n], [[0]], [n + 1], [7]).clone()
    eager, _ = runner.forward([token], [n], [n], [1], [n + 1], [[0]], [0])
    return first, graph, eager


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_one_rank_group_captures_its_collectives_in_the_decode_graphs(tmp_path, family):
    import torch.distributed as dist

    from trtedge.runtime.executor.tp import start_tensor_parallel

    checkpoint = resolve_checkpoint(make_tiny_checkpoint(tmp_path / family, family))
    plain = ModelRunner(load_model(checkpoint, **LOAD), 8, 16, None, max_batch_size=4, max_blocks_per_seq=4)
    expected = _prefill_then_decode(plain)
    tp, model = start_tensor_parallel(checkpoint, **LOAD, size=1)
    try:
        assert dist.get_backend() == "nccl" and model.tp is tp
        runner = ModelRunner(model, 8, 16, None, max_batch_size=4, max_blocks_per_seq=4)
        assert runner.graphs is not None  # captured with the NCCL all-reduces inside
        got = _prefill_then_decode(runner)
        assert runner.graphs.num_replays == 1
    finally:
        tp.shutdown()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
