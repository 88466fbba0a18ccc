"""The CPU decode products alone: each native product of a geometry's layer and its lm_head at one
activation row (a batch-1 decode step), out of cache, next to the machine's copy bandwidth.

    python benchmarks/cpu_products.py [--geometry 1b] [--threads 1,2] [--repeats 3]
                                      [--trtedge OTHER_CHECKOUT] [--prefill-rows 128,1024]
                                      [--march native]

Weights are random GGUF block bytes of the geometry's shapes as ``benchmarks/cpu_scale.py`` writes them
for a Q4_0 file: the layer's q/k/v, o, gate/up and down in Q4_0 (run as trtedge's int4, as ``--weights
auto`` keeps them) and the output projection in Q8_0 (kept as the file's blocks). Each product cycles
over enough copies of its weight to leave the last-level cache; the figure is the best of --repeats
passes, in GB/s of the weight's stored bytes. ``--trtedge DIR`` imports trtedge (and compiles its
kernels) from another checkout, say a ``git worktree`` of an earlier commit, to compare kernels with the
same script; the kernels are compiled into a temporary directory, never your cache.

``--prefill-rows 128,1024`` times the layer's int4 products at those many activation rows instead (a
prefill), at the largest of --threads: the dequantized path (``int4_dequantize`` + torch's float32
product) and ``int4_linear`` (the integer GEMM where the kernels have one), in turns in one process,
each the best of --repeats; the figure is GFLOP/s (2 M N K a product) and the ratio new / old speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

L3_BYTES = 64 * 2**20  # copies of a weight cycle through at least this much memory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--geometry", default="1b", help="a geometry of benchmarks/cpu_scale.py: 1b, 3b or 8b"
    )
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trtedge", type=Path, default=None, help="another checkout to import trtedge from")
    parser.add_argument(
        "--prefill-rows", default=None, help="comma-separated row counts: time prefill products"
    )
    parser.add_argument(
        "--march",
        default="native",
        help="compile the kernels for this -march level (x86-64-v3: the AVX2 paths on an AVX-512 CPU)",
    )
    args = parser.parse_args()
    if args.trtedge is not None:  # before anything imports trtedge (cpu_scale does)
        sys.path.insert(0, str(args.trtedge.resolve()))
    os.environ["TRTEDGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="trtedge-products-")
    import torch

    from benchmarks.cpu_scale import GEOMETRIES, _quantized
    from trtedge.runtime.artifacts.quantize import gguf_blocks, int4_from_gguf_blocks
    from trtedge.runtime.ops import cpu_kernels

    print(f"trtedge from {Path(cpu_kernels.__file__).parents[3]}")
    if args.march == "native":  # load(): also in a --trtedge checkout older than compile_kernels
        lib = cpu_kernels.load()
        if lib is None:
            sys.exit("the native CPU kernels could not be built (see the warning above)")
    else:
        try:
            lib = cpu_kernels.compile_kernels(Path(os.environ["TRTEDGE_CACHE_DIR"]) / "kernels", args.march)
        except Exception as e:
            sys.exit(f"the native CPU kernels could not be built for -march={args.march}: {e}")
    print(f"kernels compiled for -march={args.march}")
    geo = GEOMETRIES[args.geometry]
    head_dim = geo.hidden // geo.heads
    shapes = [
        ("qkv", (geo.heads + 2 * geo.kv_heads) * head_dim, geo.hidden, "Q4_0"),
        ("o", geo.hidden, geo.heads * head_dim, "Q4_0"),
        ("gate_up", 2 * geo.inter, geo.hidden, "Q4_0"),
        ("down", geo.hidden, geo.inter, "Q4_0"),
        ("lm_head", geo.vocab, geo.hidden, "Q8_0"),
    ]
    rng = np.random.default_rng(0)
    if args.prefill_rows is not None:
        int4_shapes = [(name, rows, cols) for name, rows, cols, kind in shapes if kind == "Q4_0"]
        threads = max(int(t) for t in args.threads.split(","))
        rows = [int(m) for m in args.prefill_rows.split(",")]
        prefill_products(lib, geo.name, int4_shapes, rows, threads, args.repeats, rng)
        return

    def weight(kind: str, rows: int, cols: int):
        """As ``--weights auto`` keeps it: Q4_0 as int4, Q8_0 as the file's blocks."""
        blocks = _quantized(rng, kind, rows, cols)
        if kind == "Q4_0":
            return int4_from_gguf_blocks(blocks, kind, rows, cols)
        return gguf_blocks(blocks, kind, rows, cols)

    weights = {}
    for name, rows, cols, kind in shapes:
        first = weight(kind, rows, cols)
        copies = max(1, -(-L3_BYTES // first.nbytes))
        weights[name] = [first] + [weight(kind, rows, cols) for _ in range(copies - 1)]
    copy = torch.empty(256 * 2**20 // 4)
    target = torch.empty_like(copy)
    print(f"{geo.name}: one activation row, GB/s of stored weight bytes (best of {args.repeats})")
    print(
        "| threads | copy GB/s (read + written) | "
        + " | ".join(n for n, *_ in shapes)
        + " | a step's products ms |"
    )
    print("|---:|---:|" + "---:|" * (len(shapes) + 1))
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        best = 1e9
        for _ in range(5):
            started = time.perf_counter()
            target.copy_(copy)
            best = min(best, time.perf_counter() - started)
        cells, step_ms = [], 0.0
        for name, _rows, cols, kind in shapes:
            ws = weights[name]
            x = torch.randn(1, cols)
            linear = cpu_kernels.int4_linear if kind == "Q4_0" else cpu_kernels.gguf_linear

            def product(w, x=x, linear=linear):
                return linear(lib, x, w, None)

            for w in ws:  # warm: pages touched, kernels loaded
                product(w)
            seconds = 1e9
            for _ in range(args.repeats):
                started = time.perf_counter()
                for w in ws:
                    product(w)
                seconds = min(seconds, (time.perf_counter() - started) / len(ws))
            cells.append(f"{ws[0].nbytes / seconds / 1e9:.1f}")
            step_ms += seconds * 1000 * (1 if name == "lm_head" else geo.layers)
        print(
            f"| {threads} | {2 * copy.nbytes / best / 1e9:.1f} | " + " | ".join(cells) + f" | {step_ms:.1f} |"
        )


def prefill_products(lib, name: str, shapes, row_counts, threads: int, repeats: int, rng) -> None:
    """The int4 products of a prefill: dequantized + BLAS against ``int4_linear``, in turns."""
    import torch
    import torch.nn.functional as F

    from benchmarks.cpu_scale import _quantized
    from trtedge.runtime.artifacts.quantize import int4_from_gguf_blocks
    from trtedge.runtime.ops import cpu_kernels

    torch.set_num_threads(threads)
    paths = {
        "dequantize + BLAS": lambda x, q: F.linear(x, cpu_kernels.int4_dequantize(lib, q)),
        "int4_linear": lambda x, q: cpu_kernels.int4_linear(lib, x, q, None),
    }
    print(f"{name}: int4 prefill products at {threads} threads, GFLOP/s (best of {repeats}, paths in turns)")
    print("| rows | product (N x K) | dequantize + BLAS | int4_linear | int4_linear / dequantized |")
    print("|---:|---|---:|---:|---:|")
    for m in row_counts:
        for label, n, k in shapes:
            q = int4_from_gguf_blocks(_quantized(rng, "Q4_0", n, k), "Q4_0", n, k)
            x = torch.randn(m, k)
            best = dict.fromkeys(paths, 1e9)
            for product in paths.values():  # warm: pages touched, kernels loaded
                product(x, q)
            for _ in range(repeats):
                for path, product in paths.items():
                    started = time.perf_counter()
                    product(x, q)
                    best[path] = min(best[path], time.perf_counter() - started)
            old, new = (2 * m * n * k / best[p] / 1e9 for p in paths)
            print(f"| {m} | {label} {n} x {k} | {old:.0f} | {new:.0f} | {new / old:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
