"""Where a batch-1 decode step's time goes on the GPU: graph replay alone vs the whole engine step,
the kernels of one replay (how many, per layer) and the top ones (torch profiler). For the note
when a target is missed.

    python benchmarks/gpu_step_profile.py [--shape qwen3-0.6b] [--modes default,pdl,fused]

Each mode builds the engine again: ``default`` as configured, ``pdl`` with ``TRTEDGE_PDL=1``,
``fused`` with ``TRTEDGE_DECODE_FUSION=1 TRTEDGE_PDL=1``, ``fused-no-pdl`` with the fusions only,
``epilogues`` with ``TRTEDGE_DECODE_EPILOGUES=1``, ``moe-decode`` with ``TRTEDGE_MOE_DECODE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import write_shape  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402
from trtedge.runtime.ops import pdl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--modes", default="default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_shape(Path(tmp) / args.shape, args.shape)
        first: list[int] = []
        for mode in args.modes.split(","):
            for key in (
                "TRTEDGE_PDL",
                "TRTEDGE_DECODE_FUSION",
                "TRTEDGE_DECODE_EPILOGUES",
                "TRTEDGE_MOE_DECODE",
            ):
                os.environ.pop(key, None)
            os.environ.update(MODES[mode])
            pdl._enabled = None  # probed again under this mode's TRTEDGE_PDL
            tokens = profile(directory, args.shape, mode)
            first = first or tokens
            same = next((i for i, (a, b) in enumerate(zip(tokens, first)) if a != b), len(tokens))
            print(
                json.dumps(
                    dict(figure="greedy_tokens", mode=mode, same_as_first_mode=f"{same}/{len(tokens)}")
                )
            )


MODES = {
    "default": {},
    "pdl": {"TRTEDGE_PDL": "1", "TRTEDGE_DECODE_FUSION": "0"},
    "fused": {"TRTEDGE_PDL": "1", "TRTEDGE_DECODE_FUSION": "1"},
    "fused-no-pdl": {"TRTEDGE_PDL": "0", "TRTEDGE_DECODE_FUSION": "1"},
    "epilogues": {"TRTEDGE_DECODE_EPILOGUES": "1"},
    "moe-decode": {"TRTEDGE_MOE_DECODE": "1"},
}


def profile(directory: Path, shape: str, mode: str) -> list[int]:
    """Prints the step's figures; returns the greedy tokens it decoded."""
    with LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_kv_cache_capacity=1024,
        max_input_len=512,
        engine_process=False,  # in this process: the profile replays the runner's graphs
    ) as llm:
        prompt = list(range(100, 228))
        metrics = []
        out = llm.generate(
            prompt,
            SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
            on_metrics=metrics.append,
        )
        graphs = llm.engine.runner.graphs
        graph = graphs.graphs[1]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - start) / 200 * 1e3
        step_ms = 1e3 / metrics[0].decode_tokens_per_second
        print(
            json.dumps(
                dict(
                    figure="decode_step_breakdown",
                    shape=shape,
                    mode=mode,
                    engine_step_ms=round(step_ms, 3),
                    graph_replay_ms=round(replay_ms, 3),
                    host_overhead_ms=round(step_ms - replay_ms, 3),
                )
            ),
            flush=True,
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        ]
        layers = len(llm.engine.runner.model.layers)
        print(
            json.dumps(
                dict(
                    figure="decode_step_kernels",
                    shape=shape,
                    mode=mode,
                    kernels_per_step=round(len(kernels) / 20, 1),
                    kernels_per_layer=round(len(kernels) / 20 / layers, 2),
                    layers=layers,
                    # per kernel name: two modes can launch as many kernels, and other ones
                    by_kernel={
                        name[:48]: round(count / 20, 1)
                        for name, count in Counter(e.name for e in kernels).most_common()
                    },
                )
            ),
            flush=True,
        )
        print(json.dumps(step_sequence(kernels, 20, layers, shape, mode, replay_ms)), flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
        return out.token_ids


def step_sequence(kernels, replays: int, layers: int, shape: str, mode: str, replay_ms: float) -> dict:
    """The kernels of a step in launch order, each with its mean time over the replays: the first
    two layers' worth and the step's tail (the products of a layer appear as their own slots), and
    the busy time (the kernels' sum) against the replay (the rest is gaps between kernels)."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    per_step = len(ordered) // replays
    steps = [ordered[i * per_step : (i + 1) * per_step] for i in range(replays)]
    slots = [
        (steps[0][i].name, sum(step[i].time_range.elapsed_us() for step in steps) / replays)
        for i in range(per_step)
    ]
    per_layer = max(1, per_step // layers)
    shown = [[name[:40], round(us, 2)] for name, us in slots]
    busy_us = sum(us for _, us in slots)
    return dict(
        figure="decode_step_sequence",
        shape=shape,
        mode=mode,
        busy_us=round(busy_us, 1),
        replay_us=round(replay_ms * 1e3, 1),
        gap_us=round(replay_ms * 1e3 - busy_us, 1),
        head=shown[: 2 * per_layer + 4],
        tail=shown[-(per_layer + 6) :],
    )


if __name__ == "__main__":
    main()
