"""Tensor-parallel launch: rank 0 (the calling process, which runs the engine) starts ranks 1..N-1 as
``python -m trtedge.runtime.executor.tp_worker`` processes, or joins ranks that torchrun started; each
rank loads only its slice of the weights. Every step rank 0 broadcasts the flattened batch as one small
int64 tensor (``tp_plan``) and all ranks run the same forward.

Two process groups: the model's collectives (NCCL on CUDA, gloo on the CPU) with a timeout, and a
gloo group that carries the step plans, on which idle workers wait without one. A watchdog thread
on rank 0 notices a worker that exited and marks the group failed: the next step raises
``TensorParallelError`` instead of waiting for a peer that is gone.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trtedge.runtime.executor import tp_plan
from trtedge.runtime.executor.distributed import (
    TensorParallelError,
    check_quantized_split,
    check_tensor_parallel,
    parallelize,
    shard_config,
    shard_tensor,
)
from trtedge.runtime.executor.tp_plan import Message, StateOp, StepPlan
from trtedge.runtime.models import (
    ARCHITECTURES,
    dummy_tensors,
    load_model,
    resolve_device,
    resolve_dtype,
    takes_quantized,
)
from trtedge.runtime.models.config import ModelConfig

log = logging.getLogger("trtedge")

COLLECTIVE_TIMEOUT_S = 300.0  # a step's collectives: a live peer answers within a step
IDLE_TIMEOUT = timedelta(days=30)  # workers wait for the next step plan as long as the server idles
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED_WEIGHTS = ("int8", "int4")


@dataclass(frozen=True)
class ShardLaunch:
    """What every rank needs to join the group and load its slice (sent to the spawned workers)."""

    name: str
    config: dict
    files: tuple[str, ...]  # safetensors files of the bundle; empty: random weights (load_format dummy)
    dtype: str
    device_type: str
    weight_format: str
    max_positions: int
    size: int
    init_method: str | None = None  # None: a TCP store on 127.0.0.1 that rank 0 opens
    store_port: int = 0
    weights: str = "float"  # int8 / int4: every rank loads through load_model and slices the quantized
    checkpoint: object = None  # weights with their scales; the (lock-free) checkpoint they come from

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def _prepare_env(launch: ShardLaunch, rank: int) -> torch.device:
    # NVLink multicast (NVLS) stays off: on a shared host it can take the GPUs out of service, and
    # the all-reduces of decode-sized activations gain nothing from it.
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if launch.device_type != "cuda":
        if "OMP_NUM_THREADS" not in os.environ:  # N ranks on one CPU share its cores, not oversubscribe
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.size))
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _join(launch: ShardLaunch, rank: int, store=None):
    """Init the default (compute) group and return the gloo group that carries step plans."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if launch.init_method is not None:
        dist.init_process_group(
            launch.backend, init_method=launch.init_method, rank=rank, world_size=launch.size, timeout=timeout
        )
    else:
        dist.init_process_group(
            launch.backend, store=store, rank=rank, world_size=launch.size, timeout=timeout
        )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def load_shard(launch: ShardLaunch, rank: int, device: torch.device):
    """This rank's model: its slices of the weights (read lazily from the safetensors files), joined
    by the collectives of ``parallelize``."""
    cfg = ModelConfig.from_hf(launch.config)
    if launch.weights in QUANTIZED_WEIGHTS:
        model = _load_quantized_shard(launch, rank, device)
        parallelize(model, rank, launch.size, cfg.vocab_size)
        model.tp = None
        return model
    dtype = _DTYPES[launch.dtype]
    if launch.files:
        tensors = _iter_file_shards(launch.files, cfg, rank, launch.size)
    else:
        tensors = (
            (name, shard_tensor(name, t, cfg, rank, launch.size).clone())
            for name, t in dummy_tensors(cfg, dtype, device)
        )
    local = shard_config(cfg, launch.size)
    model = ARCHITECTURES[cfg.model_type](
        local, tensors, dtype, device, launch.weight_format, launch.max_positions
    )
    parallelize(model, rank, launch.size, cfg.vocab_size)
    model.tp = None
    return model


def _load_quantized_shard(launch: ShardLaunch, rank: int, device: torch.device):
    """The whole weights quantized as one device would run them, then this rank's rows or columns of
    each with their scales (quantizing a slice would give the row-parallel layers other scales)."""

    def split(cfg: ModelConfig, tensors):
        sliced = ((name, shard_tensor(name, t, cfg, rank, launch.size)) for name, t in tensors)
        return shard_config(cfg, launch.size), sliced

    return load_model(
        launch.checkpoint,
        dtype=launch.dtype,
        device=str(device),
        weights=launch.weights,
        max_positions=launch.max_positions,
        load_format="auto" if launch.files else "dummy",
        split=split,
    )


def _iter_file_shards(files, cfg: ModelConfig, rank: int, size: int):
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, shard_tensor(name, f.get_slice(name), cfg, rank, size)


class TensorParallel:
    """Rank 0's handle on the group: sends step plans, watches the workers, shuts them down."""

    def __init__(self, launch: ShardLaunch, plan_group, processes: list):
        self.launch = launch
        self.size = launch.size
        self.plan_group = plan_group
        self.processes = processes  # the spawned workers (empty when torchrun started them)
        self._error: str | None = None
        self._closed = False
        self._state_ops: list[tuple[StateOp, list[int]]] = []  # since the last step, for the other ranks
        self._watchdog = threading.Thread(target=self._watch, name="trtedge-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def error(self) -> str | None:
        """Why the group cannot run steps any more (a worker exited, a collective failed), or None."""
        if self._error is None and not self._closed:
            dead = next(((r, p) for r, p in enumerate(self.processes, start=1) if not p.is_alive()), None)
            if dead is not None:
                self._error = f"tensor-parallel worker rank {dead[0]} exited with code {dead[1].exitcode}"
        return self._error

    def send_runner(self, **geometry) -> None:
        """The other ranks build the same runner (KV pool geometry) on their slices (once, at start)."""
        self._send(tp_plan.control(Message.RUNNER), geometry)

    def watch_states(self, pool) -> None:
        """Rank 0's recurrent-state pool: its operations outside a forward (zeroing a fresh sequence,
        snapshot copies, rollbacks) go with the next step, for the other ranks to replay first."""
        zero, copy, restore = pool.zero, pool.copy, pool.restore

        def recorded_zero(rows: list[int]) -> None:
            self._state_ops.append((StateOp.ZERO, list(rows)))
            zero(rows)

        def recorded_copy(src: list[int], dst: list[int]) -> None:
            self._state_ops.append((StateOp.COPY, [*src, *dst]))
            copy(src, dst)

        def recorded_restore(row: int, scratch_row: int) -> None:
            self._state_ops.append((StateOp.RESTORE, [row, scratch_row]))
            restore(row, scratch_row)

        pool.zero, pool.copy, pool.restore = recorded_zero, recorded_copy, recorded_restore

    def step(self, forward, plan: tuple, states=None):
        """Send the step's plan to the other ranks and run rank 0's part: ``forward(*plan)``.
        ``states``: a hybrid model's ``RecurrentBatch`` for the step."""
        self._send(tp_plan.encode(StepPlan(*plan, **self._extras(states))))
        try:
            return forward(*plan)
        except Exception as e:
            raise self._failed(e) from e

    def send_graph_step(self, ids, positions, slots, tables, context_lens, seq_ids, states=None) -> None:
        """Before rank 0 replays a decode CUDA graph (the collectives are inside it): the other ranks
        replay the same graph on the same rows."""
        n = len(ids)
        plan = StepPlan(ids, positions, slots, [1] * n, context_lens, tables, [], seq_ids=seq_ids,
                        **self._extras(states))  # fmt: skip
        self._send(tp_plan.encode(plan))

    def _extras(self, states) -> dict:
        described = None
        if states is not None:
            windows = states.windows or [0] * len(states.rows)
            described = (list(states.rows), list(states.checkpoints), list(windows))
        ops, self._state_ops = tuple(self._state_ops), []
        return {"states": described, "ops": ops}

    def _send(self, message: torch.Tensor, payload=None) -> None:
        if self.error is not None:
            raise TensorParallelError(self.error)
        try:
            send_message(message, self.plan_group)
            if payload is not None:
                dist.broadcast_object_list([payload], src=0, group=self.plan_group)
        except Exception as e:
            raise self._failed(e) from e

    def _failed(self, cause: Exception) -> TensorParallelError:
        deadline = time.monotonic() + 2  # a peer's socket closes before its exit code is in
        while self.error is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
        self._error = self.error or f"tensor-parallel group failed: {cause}"
        return TensorParallelError(self._error)

    def _watch(self) -> None:
        while not self._closed:
            if self.error is not None:
                log.error("%s; the engine is unavailable", self.error)
                if self.launch.backend == "nccl":
                    _abort_nccl()
                return
            time.sleep(0.2)

    def shutdown(self) -> None:
        if self._closed:
            return
        if self.error is None:
            try:
                self._send(tp_plan.control(Message.STOP))
            except TensorParallelError:
                pass
        self._closed = True
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        if self._error is None or self.launch.backend == "gloo":  # NCCL with a dead peer may not return
            dist.destroy_process_group()


def _abort_nccl() -> None:
    """Abort the model's NCCL communicator: a collective waiting for a rank that is gone (inside a
    replayed CUDA graph, which NCCL's own timeout does not watch) returns with an error instead of
    spinning, so rank 0's step fails and the server answers 503 rather than hanging."""
    try:
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).abort()
    except Exception as e:  # best effort: the step's own error handling still applies
        log.warning("could not abort the NCCL communicator: %s", e)


def start_tensor_parallel(
    checkpoint, *, dtype: str, device: str, weights: str, max_positions: int, load_format: str, size: int,
    init_method: str | None = None,
):  # fmt: skip
    """Start the group and load rank 0's slice: returns (TensorParallel, rank 0's model). Under torchrun
    (``init_method`` given, RANK set) a rank other than 0 serves steps here and exits when rank 0 closes."""
    cfg = checkpoint.model_config
    check_tensor_parallel(cfg, size)
    quantized = weights in QUANTIZED_WEIGHTS
    check_quantized_split(cfg, size, weights)
    if (
        weights not in ("auto", "float", *QUANTIZED_WEIGHTS)
        or getattr(checkpoint, "quantization", None)
        or checkpoint.scheme
        or (quantized and not takes_quantized(cfg))
    ):
        raise ValueError(
            "tensor_parallel_size (--tensor-parallel-size) > 1 splits float weights and --weights int8 / "
            "int4 of the llama family and Gemma 3: fp8, pre-quantized and GGUF checkpoints, and quantized "
            f"{cfg.model_type} layers, are not split across ranks yet"
        )
    if dist.is_initialized():
        raise ValueError(
            "tensor_parallel_size (--tensor-parallel-size): this process already belongs to a "
            "torch.distributed group (one tensor-parallel LLM per process; close the other first)"
        )
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, cfg, dev)
    if dev.type == "cuda" and torch.cuda.device_count() < size and "RANK" not in os.environ:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {size} needs {size} CUDA devices, "
            f"this machine has {torch.cuda.device_count()}"
        )
    launch = ShardLaunch(
        name=checkpoint.name,
        config=checkpoint.config,
        files=() if load_format == "dummy" else tuple(str(f) for f in checkpoint.weight_files()),
        dtype=str(torch_dtype).removeprefix("torch."),
        device_type=dev.type,
        weight_format="float",
        max_positions=max_positions,
        size=size,
        init_method=init_method,
        weights=weights if quantized else "float",
        checkpoint=_picklable(checkpoint) if quantized else None,
    )
    if init_method is not None and "RANK" in os.environ:  # torchrun started every rank
        world = int(os.environ.get("WORLD_SIZE", size))
        if world != size:
            raise ValueError(
                f"tensor_parallel_size (--tensor-parallel-size) {size} differs from torchrun's WORLD_SIZE {world}"
            )
        rank = int(os.environ["RANK"])
        if rank != 0:
            from trtedge.runtime.executor.tp_worker import run_worker

            run_worker(launch, rank)
            raise SystemExit(0)
        device_ = _prepare_env(launch, 0)
        plan_group = _join(launch, 0)
        processes = []
    else:
        device_, plan_group, processes = _spawn(launch)
    tp = TensorParallel(launch, plan_group, processes)
    try:
        model = load_shard(launch, 0, device_)
        dist.barrier(group=plan_group)  # every rank has its slice
    except Exception as e:
        error = tp.error or f"tensor-parallel start failed: {e}"
        tp._error = error
        tp.shutdown()
        raise TensorParallelError(error) from e
    model.tp = tp
    log.info(
        "tensor parallel: %d ranks (%s), rank 0 holds 1/%d of %s", size, launch.backend, size, launch.name
    )
    return tp, model


def _picklable(checkpoint):
    from trtedge.runtime.client import picklable_checkpoint

    return picklable_checkpoint(checkpoint)


def _spawn(launch: ShardLaunch):
    device = _prepare_env(launch, 0)
    store = None
    if launch.init_method is None:
        store = dist.TCPStore("127.0.0.1", 0, launch.size, is_master=True, wait_for_workers=False)
        launch = replace(launch, store_port=store.port)
    processes = [WorkerProcess(launch, rank, os.getpid()) for rank in range(1, launch.size)]
    if store is not None:  # fail fast when a worker dies before it joins
        ready = [f"ready/{r}" for r in range(1, launch.size)]
        while not store.check(ready):
            dead = [(r, p.exitcode) for r, p in enumerate(processes, start=1) if not p.is_alive()]
            if dead:
                raise TensorParallelError(
                    f"tensor-parallel worker rank {dead[0][0]} exited with code {dead[0][1]}"
                )
            time.sleep(0.05)
    return device, _join(launch, 0, store), processes


class WorkerProcess:
    """A rank started as ``python -m trtedge.runtime.executor.tp_worker``, its launch pickled on stdin.
    Nothing of the parent's main module runs in it (multiprocessing's spawn re-runs it, which fails for
    a script fed on stdin and re-runs an unguarded script), so a rank never depends on how the parent
    was started. Offers the ``multiprocessing.Process`` calls the group makes."""

    def __init__(self, launch: ShardLaunch, rank: int, parent: int):
        import trtedge

        root = str(Path(trtedge.__file__).resolve().parent.parent)  # wherever the parent imported it from
        paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "trtedge.runtime.executor.tp_worker"],
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        )
        with self._popen.stdin as pipe:
            pickle.dump((launch, rank, parent), pipe)
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._popen.terminate()


def send_message(buf: torch.Tensor, group) -> None:
    """Rank 0: the first ``CAPACITY`` integers in one broadcast, the rest (a large step) in a second."""
    dist.broadcast(buf[: tp_plan.CAPACITY], src=0, group=group)
    total = int(buf[1])
    if total > tp_plan.CAPACITY:
        dist.broadcast(buf[tp_plan.CAPACITY : total].contiguous(), src=0, group=group)
