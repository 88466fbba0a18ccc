"""Batch-1 products of quantized weights on CUDA against the bandwidth roof, the Qwen3-8B shapes:
per shape a device copy of the fp8 weight's bytes (the roof: its GB/s counts the bytes read and
written), cuBLAS and the Triton split-K product on bf16, then every fp8 and int4 kernel variant and
tiling (``triton_quant``'s decode products with the quick tuner's plans and ``triton_quant_gemv``'s
one-row ones), each checked against its torch reference (``max_rel_err``).

Each figure replays a CUDA graph of CALLS calls that cycle through copies of the weight (together
past the 50 MB L2, as a decode step reads each weight once), timed with CUDA events; one JSON line
per figure with microseconds per call and GB/s of weight bytes (scales included). ``--budget-s``
stops the sweep once that many seconds have passed (a last line names the shape it stopped at).

    python benchmarks/gpu_quant_gemv.py [--shapes 8b.gate_up 8b.down] [--budget-s 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_gemv import SHAPES  # noqa: E402
from trtedge.runtime.ops.triton_gemv import SkinnyLinear  # noqa: E402

CALLS = 100


def time_graph(fn, calls: int = CALLS) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * calls)


L2_BYTES = 256 << 20  # the copies of a weight one timing cycles through: past the H200's 50 MB L2
# (BLOCK_N, BLOCK_K, num_warps) of the one-row kernels; each with the splits that fit the shape
GEMV_TILES = ((32, 256, 4), (64, 256, 4), (64, 512, 8), (128, 256, 8), (64, 128, 4), (32, 128, 4))
SPLITS = (1, 2, 4, 8)


def time_cycle(fn, operands) -> float:
    """Microseconds per call of ``fn(operand)``, CALLS calls in one CUDA graph, each on the next of
    ``operands`` (copies of one weight) in turn."""
    return time_graph(_Cycle(fn, operands))


class _Cycle:
    def __init__(self, fn, operands):
        self.fn, self.operands, self.i = fn, operands, 0

    def __call__(self):
        self.fn(self.operands[self.i % len(self.operands)])
        self.i += 1


def _splits(n: int, k: int, block_n: int, block_k: int) -> list[int]:
    """The (at most two) smallest split-K factors that give at least a wave of programs (132 SMs)."""
    tiles = -(-n // block_n)
    fit = [s for s in SPLITS if k // s >= block_k and (s == 1 or tiles * (s // 2) < 2 * 132)]
    wave = [s for s in fit if tiles * s >= 132]
    return wave[:2] or fit[-1:]


def _copies(nbytes: int) -> int:
    return max(1, min(16, -(-L2_BYTES // nbytes)))


def _workspace(n: int, device) -> SimpleNamespace:
    """Split-K partials and counters for any plan of SPLITS (``triton_quant.Workspace``'s shape)."""
    return SimpleNamespace(
        partials=torch.empty(max(SPLITS) * 16 * n, device=device),
        counts=torch.zeros(-(-n // 16), dtype=torch.int32, device=device),
    )


def _fp8_weight(n: int, k: int, seed: int):
    from trtedge.runtime.artifacts.quantize import QuantizedTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    data = (torch.randn(n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, 1, device="cuda", generator=g) * 1e-3 + 1e-4
    return QuantizedTensor("fp8", data, scale)


def _int4_weight(n: int, k: int, seed: int):
    """A random weight in ``triton_quant``'s GPU int4 layout."""
    from trtedge.runtime.artifacts.quantize import QuantizedTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (n, k // 2), device="cuda", generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, device="cuda", generator=g) * 1e-2 + 1e-3).half()
    return QuantizedTensor("int4", data, scale, (-8 * scale.float()).half())


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((out.float() - ref).abs().max() / ref.abs().max()).item(), 6)


def quant_sweep(names: list[str], budget_s: float) -> None:
    started = time.monotonic()
    for name in names:
        if time.monotonic() - started > budget_s:
            print(json.dumps({"stopped": "budget", "at_shape": name}), flush=True)
            return
        _sweep_shape(name, started + budget_s)
        torch.cuda.empty_cache()


def _sweep_shape(name: str, deadline: float) -> None:
    from benchmarks.gpu_quant import QUICK_INT4, QUICK_W8
    from trtedge.runtime.ops import triton_quant as tq
    from trtedge.runtime.ops import triton_quant_gemv as tg

    n, k = SHAPES[name]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ws = _workspace(n, x.device)

    def emit(kind, fn, operands, gbytes, ref=None, **extra):
        if time.monotonic() > deadline:
            return
        line = {"shape": name, "n": n, "k": k, "kind": kind, **extra}
        try:
            got = fn(operands[0]) if ref is not None else None
            us = time_cycle(fn, operands)
            line.update(us=round(us, 2), gbps=round(gbytes / us * 1e6, 1))
            if ref is not None:
                line["max_rel_err"] = _rel_err(got, ref)
        except Exception as e:  # a variant that does not compile here: the others still run
            line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(line), flush=True)

    # the roof: a device copy of the fp8 weight's bytes (read + written)
    src = [torch.empty(n * k, dtype=torch.uint8, device="cuda") for _ in range(_copies(n * k))]
    dst = torch.empty(n * k, dtype=torch.uint8, device="cuda")
    emit("copy", dst.copy_, src, 2 * n * k / 1e9)
    src = dst = None
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(_copies(2 * n * k))]
    emit("bf16_cublas", lambda w: F.linear(x, w), w16, 2 * n * k / 1e9)
    lins = [SkinnyLinear(w, None) for w in w16]
    plan = lins[0].plan(1)  # None: cuBLAS
    for lin in lins:
        if plan is not None:
            lin._reserve(plan)
    emit(
        "bf16_triton",
        lambda lin: lin.launch(x, plan) if plan else F.linear(x, lin.weight),
        lins,
        2 * n * k / 1e9,
        plan=plan,
    )
    w16 = lins = None

    fp8 = [_fp8_weight(n, k, i) for i in range(_copies(n * k))]
    ref = tq.w8_reference(x, fp8[0], None)
    gb = (n * k + 4 * n) / 1e9
    for plan in (p for p in QUICK_W8 if p in tq.candidates(QUICK_W8, n, k)):
        emit("fp8_old", lambda q, p=plan: tq.w8_product(x, q, None, p, ws), fp8, gb, ref, plan=plan)
    for mode in (0, 1):
        for bn, bk, warps in GEMV_TILES:
            for split in _splits(n, k, bn, bk):
                plan = (bn, bk, split, warps)
                gemv = lambda q, p=plan, m=mode: tg.w8_gemv(x, q, None, p, ws, m)  # noqa: E731
                emit(f"fp8_gemv{mode}", gemv, fp8, gb, ref, plan=plan)
    fp8 = ref = None

    int4 = [_int4_weight(n, k, i) for i in range(_copies(n * k // 2))]
    ref = tq.int4_reference(x, int4[0], None)
    gb = (n * k // 2 + 4 * n * k // 32) / 1e9
    for plan in (p for p in QUICK_INT4 if p in tq.candidates(QUICK_INT4, n, k)):
        emit("int4_old", lambda q, p=plan: tq.int4_product(x, q, None, p, ws), int4, gb, ref, plan=plan)
    for convert in (True, False):
        for bn, bk, warps in GEMV_TILES:
            for split in _splits(n, k, bn, bk):
                plan = (bn, bk, split, warps)
                gemv = lambda q, p=plan, c=convert: tg.int4_gemv(x, q, None, p, ws, c)  # noqa: E731
                emit(f"int4_gemv_{'asm' if convert else 'cast'}", gemv, int4, gb, ref, plan=plan)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shapes", nargs="+", default=["8b.gate_up", "8b.down", "8b.qkv", "8b.o", "8b.lm_head"]
    )
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop after this many seconds")
    args = parser.parse_args()
    quant_sweep(args.shapes, args.budget_s)


if __name__ == "__main__":
    main()
