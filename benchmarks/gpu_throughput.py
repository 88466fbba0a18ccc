"""Offline throughput on nano-vllm's workload: trtedge vs HF transformers' continuous batching.

    python benchmarks/gpu_throughput.py [--requests 256] [--hf-requests 32]

Qwen3-0.6B shape, random bf16 weights (load_format="dummy"), input and output lengths uniform in
[100, 1024], temperature 0.6, EOS ignored. Prints one JSON line per figure. HF's
``generate_batch`` takes one max_new_tokens for all requests, so it runs on its own subset with
max_new_tokens = the workload's mean output length; its figure is output tokens per second too.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import qwen3_config, write_shape  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402
from trtedge.runtime.profiling import GcPauses  # noqa: E402


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, 150000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
        for _ in range(n)
    ]


def run_trtedge(
    directory: Path,
    requests,
    max_batch_size: int,
    overlap: bool | None = None,
    busy: bool = False,
    process: bool | None = None,
    kv_cache_dtype: str = "auto",
    top: int = 12,
    step_times: bool = False,
) -> dict:
    with LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        enable_in_flight_batching=True,
        max_batch_size=max_batch_size,
        max_kv_cache_capacity=2048,
        max_input_len=1024,
        max_num_batched_tokens=8192,
        async_scheduling=overlap,
        engine_process=False if busy else process,  # the profiler sees this process's kernels only
        kv_cache_dtype=kv_cache_dtype,
    ) as llm:
        llm.generate(
            requests[0][0], SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True)
        )  # warm-up
        profiler = None
        # the collector's time over the run: the engine-core process counts its own (stats["gc"])
        pauses = None if llm.engine_process else GcPauses()
        if step_times:  # the engine's own stage timers: CUDA events around each model step
            llm.reset_profiling_metrics()
            llm.set_profiling_enabled(True)
        if busy:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        start = time.perf_counter()
        streams = [
            llm.generate_stream(
                prompt, SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, seed=i)
            )
            for i, (prompt, n) in enumerate(requests)
        ]
        produced = sum(len(d.token_ids) for s in streams for d in s)
        elapsed = time.perf_counter() - start
        stats = llm.stats()
        if pauses is not None:
            stats["gc"] = pauses.as_dict()
            pauses.close()
        steps = llm.get_profiling_metrics() if step_times else None
        engine_process = llm.engine_process
    extra = {}
    if steps is not None:
        # the GPU time from each model step's first queued work to its last (idle between steps is
        # not in it; idle inside a step is, so this bounds the busy share from above)
        device = steps.prefill.total_time + steps.generation.total_time
        extra = dict(device_step_seconds=round(device, 3), device_steps_of_wall=round(device / elapsed, 3))
    if profiler is not None:
        profiler.__exit__(None, None, None)
        extra = gpu_busy(profiler, elapsed, top)
    return dict(
        **extra,
        output_tokens=produced,
        seconds=round(elapsed, 2),
        output_tokens_per_s=round(produced / elapsed, 1),
        steps=stats["steps"],
        preemptions=stats["preemptions"],
        gc=stats.get("gc"),
        engine_process=engine_process,
        kv_cache_dtype=kv_cache_dtype,
    )


def gpu_busy(profiler, wall: float, top: int = 12) -> dict:
    """The share of the run's wall time in which some kernel ran: the union of the kernels' intervals
    (CUPTI timestamps) over the wall time, and over the span from the first kernel to the last."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in profiler.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end, first = 0, None, spans[0][0] if spans else 0
    gaps = {"<10us": [0, 0], "10-100us": [0, 0], "100us-1ms": [0, 0], ">=1ms": [0, 0]}
    largest = []  # (gap, its start from the first kernel, the kernel before, the kernel after)
    before = ""
    for a, b, name in spans:
        if end is not None and a > end:
            gap = a - end
            largest.append((gap, end - first, before, name))
            key = "<10us" if gap < 10 else "10-100us" if gap < 100 else "100us-1ms" if gap < 1000 else ">=1ms"
            gaps[key][0] += 1
            gaps[key][1] += gap
        if end is None or a > end:
            busy += b - a
            end, before = b, name
        elif b > end:
            busy += b - end
            end, before = b, name
    span = (end - first) if spans else 0
    kernels = sorted(profiler.key_averages(), key=lambda a: -a.device_time_total)[:top]
    return dict(
        top_kernels_ms=[[a.key[:90], round(a.device_time_total / 1e3, 1), a.count] for a in kernels],
        idle_gaps_count_ms={k: [n, round(us / 1e3, 1)] for k, (n, us) in gaps.items()},
        largest_gaps_ms_at_before_after=[
            [round(g / 1e3, 2), round(at / 1e3, 1), x[:40], y[:40]] for g, at, x, y in sorted(largest)[-top:]
        ],
        gpu_busy_us=round(busy),
        gpu_busy_of_wall=round(busy / 1e6 / wall, 3),
        gpu_busy_of_kernel_span=round(busy / span, 3) if span else 0.0,
    )


def run_hf(requests) -> dict:
    import transformers

    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in qwen3_config("qwen3-0.6b").items() if k != "architectures"}
    )
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    new_tokens = round(sum(n for _, n in requests) / len(requests))
    gen = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=True, temperature=0.6, eos_token_id=None, pad_token_id=0
    )
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(inputs=[p for p, _ in requests], generation_config=gen)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in out.values())
    return dict(
        requests=len(requests),
        max_new_tokens=new_tokens,
        output_tokens=produced,
        seconds=round(elapsed, 2),
        output_tokens_per_s=round(produced / elapsed, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=32, help="0 skips HF")
    parser.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off", "both"],
        default="both",
        help="both: the synchronous engine and the overlapped one in the same run",
    )
    parser.add_argument(
        "--engine-process",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="the engine core in its own process (on), in this one (off), or both in the same run",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma-separated: each in the same run (auto: the model's dtype; fp8: E4M3 with row scales)",
    )
    parser.add_argument(
        "--gpu-busy",
        action="store_true",
        help="also a profiled run: the share of the time a kernel ran",
    )
    parser.add_argument(
        "--top", type=int, default=12, help="--gpu-busy: how many kernels the profiled run lists"
    )
    parser.add_argument(
        "--step-times",
        action="store_true",
        help="the engine times each model step on the GPU (CUDA events), in its own process too",
    )
    args = parser.parse_args()
    requests = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_shape(Path(tmp) / "qwen3-0.6b", "qwen3-0.6b")
        modes = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.async_scheduling]
        procs = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.engine_process]
        kv_dtypes = args.kv_cache_dtype.split(",")
        runs = [(m, False, p, kv) for kv in kv_dtypes for m in modes for p in procs]
        runs += [(modes[-1], True, False, kv) for kv in kv_dtypes] if args.gpu_busy else []
        for overlap, busy, process, kv in runs:
            row = run_trtedge(
                directory,
                requests,
                args.max_batch_size,
                overlap,
                busy,
                process,
                kv,
                args.top,
                args.step_times and not busy,
            )
            print(
                json.dumps(
                    dict(
                        figure="offline_throughput",
                        engine="trtedge",
                        async_scheduling={None: "auto", True: "on", False: "off"}[overlap],
                        profiled=busy,
                        shape="qwen3-0.6b",
                        requests=args.requests,
                        **row,
                    )
                ),
                flush=True,
            )
    if args.hf_requests:
        try:
            hf = run_hf(requests[: args.hf_requests])
            print(
                json.dumps(
                    dict(
                        figure="offline_throughput",
                        engine="hf-transformers-generate_batch",
                        shape="qwen3-0.6b",
                        **hf,
                    )
                ),
                flush=True,
            )
        except Exception as e:
            print(
                json.dumps(
                    dict(
                        figure="offline_throughput",
                        engine="hf-transformers-generate_batch",
                        error=f"{type(e).__name__}: {e}"[:300],
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
