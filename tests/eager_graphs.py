"""A CPU stand-in for the runner's CUDA decode graphs (executor/cuda_graphs.DecodeGraphs): the same
interface, the logits of every row of a one-token-per-row step computed eagerly, and a count of the
steps it took. Tests that need the graph path on the CPU install it as ``engine.runner.graphs``."""

from __future__ import annotations


class EagerGraphs:
    def __init__(self, runner):
        self.runner, self.calls = runner, 0
        self.aux_layers = runner.model.aux_layers  # the taps it was "captured" with, as DecodeGraphs records

    def fits(self, num_seqs: int) -> bool:
        return True

    def run(self, ids, positions, slots, tables, context_lens, fill=None, seq_ids=None, rows=None, raw=False):
        assert isinstance(positions, list), "decode graphs got multimodal (3, T) positions"
        self.calls += 1
        n = len(ids)
        logits, _ = self.runner.forward(
            ids, positions, slots, [1] * n, context_lens, tables, list(range(n)), fill=fill
        )
        return logits
