"""Decode-sized matrix products on CUDA: cuBLAS (``F.linear``) against trtedge's Triton split-K
product (``SkinnyLinear``, with the plan it picks by timing) for the Qwen3-0.6B and Qwen3-8B projection shapes, bf16.

Each figure times 100 calls captured in one CUDA graph (no launch gaps from Python) and prints a
JSON line with microseconds per call and the achieved weight-read bandwidth.

    python benchmarks/gpu_gemv.py [--rows 1 4 16] [--sweep]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from trtedge.runtime.ops.triton_gemv import SkinnyLinear

SHAPES = {  # name -> (N, K) of the weight
    "0.6b.qkv": (4096, 1024),
    "0.6b.o": (1024, 2048),
    "0.6b.gate_up": (6144, 1024),
    "0.6b.down": (1024, 3072),
    "0.6b.lm_head": (151936, 1024),
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.gate_up": (24576, 4096),
    "8b.down": (4096, 12288),
    "8b.lm_head": (151936, 4096),
}
CALLS = 100


def time_graph(fn) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of CALLS calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * CALLS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sweep", action="store_true", help="also time other tile/split choices")
    args = parser.parse_args()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        gbytes = w.numel() * 2 / 1e9
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            lin = SkinnyLinear(w, None)
            cublas = time_graph(lambda x=x, w=w: F.linear(x, w))
            # the plan the layer picked by timing (None: cuBLAS)
            planned = time_graph(lambda x=x, lin=lin: lin(x))
            line = {
                "shape": name,
                "rows": rows,
                "cublas_us": round(cublas, 2),
                "cublas_tbps": round(gbytes / cublas * 1e3, 2),
                "triton_us": round(planned, 2),
                "triton_tbps": round(gbytes / planned * 1e3, 2),
                "plan": lin.plan(rows),
            }
            if args.sweep and rows == 1:
                best = (planned, line["plan"])
                for block_n in (16, 32, 64, 128):
                    for block_k in (128, 256, 512):
                        for split in (1, 2, 4, 8, 16):
                            if k // split < block_k or block_n * block_k > 32768:
                                continue
                            plan = (block_n, block_k, split)
                            lin._reserve(plan)
                            us = time_graph(lambda plan=plan, x=x, lin=lin: lin.launch(x, plan))
                            if us < best[0]:
                                best = (us, [block_n, block_k, split])
                line["best_us"] = round(best[0], 2)
                line["best_tbps"] = round(gbytes / best[0] * 1e3, 2)
                line["best_plan"] = best[1]
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
