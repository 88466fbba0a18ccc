"""A CPU stand-in for the runner's CUDA decode graphs (executor/cuda_graphs.DecodeGraphs): the same
interface, the logits of every row of a one-token-per-row step computed eagerly, and a count of the
steps it took. Tests that need the graph path on the CPU install it as ``engine.runner.graphs``. With
``verify_chains`` a hybrid model's verify chains run through the recurrent layers' torch reference of
the chained kernels (``state_pool.Chains``)."""

from __future__ import annotations

import torch

from trtedge.runtime.executor.state_pool import RecurrentBatch


class EagerGraphs:
    def __init__(self, runner, verify_chains: bool = False):
        self.runner, self.calls, self.chain_calls = runner, 0, 0
        self.verify_chains = verify_chains
        self.aux_layers = runner.model.aux_layers  # the taps it was "captured" with, as DecodeGraphs records

    def fits(self, num_seqs: int) -> bool:
        return True

    def run(
        self,
        ids,
        positions,
        slots,
        tables,
        context_lens,
        fill=None,
        seq_ids=None,
        rows=None,
        raw=False,
        chains=None,
    ):
        assert isinstance(positions, list), "decode graphs got multimodal (3, T) positions"
        self.calls += 1
        n = len(ids)
        runner, step_states = self.runner, self.runner._step_states
        if chains is not None:  # as the captured step's RecurrentBatch: rows, chain lengths, scratch rows
            assert self.verify_chains and len(rows) == len(chains[0]) == len(chains[1]) == n
            self.chain_calls += 1
            runner._step_states = RecurrentBatch(
                runner.states,
                rows,
                [1] * n,
                [None] * n,
                torch.tensor(rows),
                lens_tensor=torch.tensor(chains[0]),
                saves_tensor=torch.tensor(chains[1]),
            )
        try:
            logits, _ = runner.forward(
                ids, positions, slots, [1] * n, context_lens, tables, list(range(n)), fill=fill
            )
        finally:
            runner._step_states = step_states
        return logits
