"""A tensor-parallel worker rank: ``python -m trtedge.runtime.executor.tp_worker``, started by rank 0
(``tp.WorkerProcess``), which pickles (launch, rank, parent pid) onto its stdin; or a rank other than 0
that torchrun started. It loads its slice, then runs each step rank 0 broadcasts until rank 0 stops."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from trtedge.runtime.core.hybrid_state import HybridStateCache
from trtedge.runtime.executor import tp_plan
from trtedge.runtime.executor.distributed import TensorParallelError
from trtedge.runtime.executor.state_pool import RecurrentBatch, plan_windows
from trtedge.runtime.executor.tp import ShardLaunch, _join, _prepare_env, load_shard
from trtedge.runtime.executor.tp_plan import Message, StateOp, StepPlan


def main() -> None:
    launch, rank, parent = pickle.load(sys.stdin.buffer)
    serve_rank(launch, rank, parent)


def serve_rank(launch: ShardLaunch, rank: int, parent: int) -> None:
    """A spawned worker process's whole life: join, serve steps, exit with the parent."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    store = None
    if launch.init_method is None:
        store = dist.TCPStore("127.0.0.1", launch.store_port, launch.size, is_master=False)
        store.set(f"ready/{rank}", "1")
    code = 0
    try:
        run_worker(launch, rank, store)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch: seconds, and nothing left to save


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run_worker(launch: ShardLaunch, rank: int, store=None) -> None:
    """A rank other than 0: load the slice, then run each step rank 0 sends until it sends STOP."""
    from trtedge.runtime.executor.runner import ModelRunner

    device = _prepare_env(launch, rank)
    plan_group = _join(launch, rank, store)
    model = load_shard(launch, rank, device)
    dist.barrier(group=plan_group)
    runner = None
    while True:
        message = receive_message(plan_group)
        kind = int(message[0])
        if kind == Message.STOP:
            break
        if kind == Message.RUNNER:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=plan_group)
            geometry = box[0]
            state = geometry.pop("state", None)
            if state is not None:  # (slots, snapshots, draft-window rows): the same pool, this rank's heads
                slots, snapshots, window_rows = state
                state = HybridStateCache(
                    slots, snapshots, geometry["block_size"], num_window_rows=window_rows
                )
            runner = ModelRunner(model, sampler=None, state=state, **geometry)
        else:
            plan = tp_plan.decode(message)
            _replay_states(runner, plan)
            if plan.seq_ids is not None:
                args = (plan.ids, plan.positions, plan.slots, plan.tables, plan.context_lens, plan.seq_ids)
                if runner.graph_logits(*args) is None:
                    raise TensorParallelError(
                        "internal error: rank 0 replayed a decode graph this rank lacks"
                    )
            else:
                runner.forward(*plan.args())
    dist.destroy_process_group()


def _replay_states(runner, plan: StepPlan) -> None:
    """A worker: rank 0's pool operations since the last step, then this step's recurrent batch."""
    pool = runner.states
    for op, values in plan.ops:
        if op == StateOp.ZERO:
            pool.zero(values)
        elif op == StateOp.COPY:
            half = len(values) // 2
            pool.copy(values[:half], values[half:])
        else:
            pool.restore(*values)
    if plan.states is None:
        return
    rows, checkpoints, windows = plan.states
    rows_tensor = torch.tensor(rows, dtype=torch.long, device=runner.model.device)
    batch = RecurrentBatch(pool, rows, list(plan.query_lens), checkpoints, rows_tensor)
    if any(windows):
        batch.windows = windows
        batch.plan = plan_windows(pool, rows, batch.query_lens, checkpoints, windows)
    runner._step_states = batch  # what rank 0's runner.recurrent_batch built for its forward


def receive_message(group) -> torch.Tensor:
    buf = torch.empty(tp_plan.CAPACITY, dtype=torch.long)
    dist.broadcast(buf, src=0, group=group)
    total = int(buf[1])
    if total > tp_plan.CAPACITY:
        rest = torch.empty(total - tp_plan.CAPACITY, dtype=torch.long)
        dist.broadcast(rest, src=0, group=group)
        buf = torch.cat([buf, rest])
    return buf


if __name__ == "__main__":
    main()
