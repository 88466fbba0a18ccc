"""Greedy parity: the engine core in its own process vs in this one, in one run.

    python benchmarks/engine_process_parity.py [float32|bfloat16]

Qwen3-0.6B shape, random weights (load_format="dummy", seeded), CUDA, 8 prompts x 32 greedy tokens;
prints each side's start-up time and whether every row's tokens are equal."""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.shapes import write_shape
from trtedge import LLM, SamplingParams

with tempfile.TemporaryDirectory() as tmp:
    d = write_shape(Path(tmp) / "q", "qwen3-0.6b")
    prompts = [[(7 * i + 13 * j) % 150000 + 10 for j in range(50 + 10 * i)] for i in range(8)]
    outs = {}
    for proc in (False, True):
        t = time.perf_counter()
        with LLM(
            str(d),
            load_format="dummy",
            dtype=sys.argv[1] if len(sys.argv) > 1 else "bfloat16",
            device="cuda",
            enable_in_flight_batching=True,
            max_batch_size=8,
            max_kv_cache_capacity=2048,
            max_input_len=1024,
            engine_process=proc,
        ) as llm:
            start = time.perf_counter() - t
            r = llm.generate(
                prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
            )
            outs[proc] = [o.token_ids for o in r]
            print(
                json.dumps(
                    dict(
                        engine_process=proc,
                        start_s=round(start, 1),
                        describe=llm.describe().to_dict(),
                        stats_steps=llm.stats()["steps"],
                    )
                ),
                flush=True,
            )
    print(
        json.dumps(
            dict(
                figure="greedy_parity_process_vs_inprocess",
                equal=outs[True] == outs[False],
                rows_equal=sum(a == b for a, b in zip(outs[True], outs[False])),
            )
        ),
        flush=True,
    )
