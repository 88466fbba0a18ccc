"""A CPU stand-in for the runner's CUDA decode graphs (executor/cuda_graphs.DecodeGraphs): the same
interface, the logits of every row of a one-token-per-row step computed eagerly, and a count of the
steps it took. Tests that need the graph path on the CPU install it as ``engine.runner.graphs``. With
``verify_chains`` a hybrid model's verify chains run through the recurrent layers' torch reference of
the chained kernels (``state_pool.Chains``)."""

from __future__ import annotations

from trtedge.runtime.executor.cuda_graphs import StepInputs


class EagerGraphs:
    def __init__(self, runner, verify_chains: bool = False):
        self.runner, self.calls, self.chain_calls = runner, 0, 0
        self.aux_layers = runner.model.aux_layers  # the taps it was "captured" with, as DecodeGraphs records
        self.verify_chains = verify_chains
        self.io = None
        if verify_chains:  # the graphs' own staged inputs, so the chains reach the model as on CUDA
            pad = runner.states.pad_row
            self.io = StepInputs(
                [1, 2, 4, 8, 16, 32, 64], 64, runner.block_size, runner.num_blocks, pad, "cpu", True
            )

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
        if (
            chains is not None
        ):  # the rows' state rows, chain lengths and scratch rows, as a captured step reads them
            assert self.verify_chains and len(rows) == len(chains[0]) == len(chains[1]) == n
            self.chain_calls += 1
            size = self.io.stage(ids, positions, slots, tables, context_lens, None, seq_ids, rows, chains)
            self.io.unstage(size)
            batch = self.io.recurrent_batch(runner.states, size)
            batch.query_lens, batch.checkpoints = [1] * n, [None] * n
            batch.rows_tensor, batch.lens_tensor, batch.saves_tensor = (
                t[:n] for t in (batch.rows_tensor, batch.lens_tensor, batch.saves_tensor)
            )
            runner._step_states = batch
        try:
            logits, _ = runner.forward(
                ids, positions, slots, [1] * n, context_lens, tables, list(range(n)), fill=fill
            )
        finally:
            runner._step_states = step_states
        return logits
