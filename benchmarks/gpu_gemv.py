"""Decode-sized matrix products on CUDA against the bandwidth roof: cuBLAS (``F.linear``), trtedge's
Triton split-K product (``SkinnyLinear``, the plan it picks by timing), and with ``--sweep`` every
candidate tiling of its two kernels (tensor-core ``_skinny_kernel`` and the one-row ``_vector_kernel``:
BLOCK_N, BLOCK_K, split-K, num_warps, num_stages, unrolled spans), bf16.

Each figure replays a CUDA graph of calls that cycle through copies of the weight (together more
than the L2 cache, as a decode step reads each layer's weight once), timed with CUDA events. The roof
is a device copy of the same bytes: ``roof_us`` = the time to read them at the copy's bandwidth
(read + write bytes / copy time). One JSON line per figure; the sweep's candidates go outer and
shapes inner, so each tiling compiles once, and stop when ``--budget-s`` is spent (a last line says
how many were left).

    python benchmarks/gpu_gemv.py [--shapes 8b] [--rows 1 4 16] [--sweep] [--budget-s 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtedge.runtime.ops.triton_gemv import SkinnyLinear  # noqa: E402

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
    "1b.qkv": (3072, 2048),  # Llama-3.2-1B geometry
    "1b.o": (2048, 2048),
    "1b.gate_up": (16384, 2048),
    "1b.down": (2048, 8192),
    "1b.lm_head": (128256, 2048),
}
COLD_BYTES = 384 << 20  # the weight copies a figure cycles through: well past the 50 MB L2
MIN_CALLS = 40


class Shape:
    def __init__(self, name: str, n: int, k: int):
        self.name, self.n, self.k = name, n, k
        self.nbytes = n * k * 2
        copies = max(1, -(-COLD_BYTES // self.nbytes))
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        self.layers = [SkinnyLinear(w, None) for w in self.weights]
        self.calls = copies * -(-MIN_CALLS // copies)
        self.x = {}

    def rows(self, m: int) -> torch.Tensor:
        if m not in self.x:
            self.x[m] = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        return self.x[m]

    def time(self, fn, same_weight: bool = False) -> float:
        """Microseconds per call of ``fn(i)`` (i: the weight copy), from a graph of ``calls`` calls."""
        calls = [0] * MIN_CALLS if same_weight else [i % len(self.weights) for i in range(self.calls)]
        for i in range(min(3, len(self.weights))):
            fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in calls:
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / (5 * len(calls))

    def emit(self, us: float, **fields) -> None:
        line = {"shape": self.name, **fields, "us": round(us, 2), "tbps": round(self.nbytes / us / 1e6, 3)}
        if hasattr(self, "roof_us"):
            line["pct_roof"] = round(100 * self.roof_us / us, 1)
        print(json.dumps(line), flush=True)


def baseline(shape: Shape, rows: int) -> None:
    """The copy roof (once), cuBLAS and the plan ``SkinnyLinear`` picks, at ``rows`` rows."""
    if not hasattr(shape, "roof_us"):
        dst = torch.empty_like(shape.weights[0])
        copy_us = shape.time(lambda i: dst.copy_(shape.weights[i]))
        shape.roof_us = copy_us / 2  # the copy moves the bytes twice
        print(json.dumps({
            "shape": shape.name, "kernel": "copy", "copy_us": round(copy_us, 2),
            "copy_tbps": round(2 * shape.nbytes / copy_us / 1e6, 3), "roof_us": round(shape.roof_us, 2),
        }), flush=True)  # fmt: skip
    x = shape.rows(rows)
    shape.emit(shape.time(lambda i: F.linear(x, shape.weights[i])), kernel="cublas", rows=rows)
    plan = shape.layers[0].plan(rows)
    for layer in shape.layers:
        layer.plan(rows)  # reserves each copy's partials
    shape.emit(shape.time(lambda i: shape.layers[i](x)), kernel="picked", rows=rows, plan=plan)
    if rows == 1:
        shape.emit(
            shape.time(lambda i: shape.layers[i](x), same_weight=True),
            kernel="picked_same_weight", rows=rows, plan=plan,
        )  # fmt: skip


def sweep_candidates(shapes: list[Shape]):
    """(kernel, plan, options, shapes it fits), the likeliest first."""
    out = []

    def vector(bn, bk, split, warps=4, stages=3, unroll=False):
        fits = []
        for s in shapes:
            span = -(-s.k // (split * bk)) * bk
            if s.k // split < bk or (unroll and (span // bk > 8 or bn * span > 16384)):
                continue
            fits.append(s)
        out.append(("vector", (bn, bk, split), dict(num_warps=warps, num_stages=stages, unroll=unroll), fits))

    def dot(bn, bk, split, warps=4, stages=3):
        fits = [s for s in shapes if s.k // split >= bk]
        out.append(("dot", (bn, bk, split), dict(num_warps=warps, num_stages=stages), fits))

    for split in (1, 2, 4, 8):
        for bn, bk in ((32, 256), (16, 256), (64, 128), (16, 512)):
            vector(bn, bk, split)
    for plan in ((32, 128, 1), (64, 128, 1), (64, 256, 1), (32, 128, 4), (32, 128, 8), (64, 128, 4),
                 (128, 128, 4)):  # fmt: skip
        for warps, stages in ((4, 3), (4, 4), (8, 3), (2, 3), (4, 2)):
            dot(*plan, warps, stages)
    for split in (2, 4, 8, 16):
        for bn in (16, 32):
            vector(bn, 256, split, unroll=True)
    for split in (1, 2, 4, 8):
        for bn, bk in ((32, 256), (16, 256), (64, 128)):
            vector(bn, bk, split, warps=8)
            vector(bn, bk, split, warps=2)
            vector(bn, bk, split, stages=2)
    for plan in ((16, 256, 1), (16, 256, 4), (32, 256, 2), (32, 256, 4), (16, 128, 8)):
        for warps, stages in ((4, 3), (4, 4), (8, 4)):
            dot(*plan, warps, stages)
    return out


def sweep(shapes: list[Shape], budget_s: float, started: float) -> None:
    candidates = sweep_candidates(shapes)
    for done, (kernel, plan, options, fits) in enumerate(candidates):
        if time.monotonic() - started > budget_s:
            print(
                json.dumps({"sweep": "budget spent", "candidates_left": len(candidates) - done}), flush=True
            )
            return
        for s in fits:
            x = s.rows(1)
            for layer in s.layers:
                layer._reserve(plan)
            if kernel == "vector":
                fn = lambda i, s=s, x=x, p=plan, o=options: s.layers[i].launch_vector(x, p, **o)  # noqa: E731
            else:
                fn = lambda i, s=s, x=x, p=plan, o=options: s.layers[i].launch(x, p, **o)  # noqa: E731
            try:
                us = s.time(fn)
            except Exception as e:  # a tiling that does not compile or launch: report, keep going
                print(json.dumps({"shape": s.name, "kernel": kernel, "plan": plan, **options,
                                  "error": repr(e)[:200]}), flush=True)  # fmt: skip
                continue
            ref = F.linear(x.float(), s.weights[0].float())
            err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
            s.emit(us, kernel=kernel, rows=1, plan=plan, **options, rel_err=float(f"{err:.1e}"))
    print(json.dumps({"sweep": "done", "candidates": len(candidates)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="0.6b,8b", help="prefixes of SHAPES' names, comma-separated")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sweep", action="store_true", help="also time every candidate tiling at 1 row")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop the sweep after this long")
    args = parser.parse_args()
    started = time.monotonic()
    prefixes = tuple(p + "." for p in args.shapes.split(","))
    shapes = [Shape(name, n, k) for name, (n, k) in SHAPES.items() if name.startswith(prefixes)]
    for shape in shapes:
        for rows in args.rows:
            baseline(shape, rows)
    if args.sweep:
        sweep(shapes, args.budget_s, started)


if __name__ == "__main__":
    main()
