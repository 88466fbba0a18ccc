"""The prefill products of the Qwen3-8B shape, bf16 against fp8, and the parts of the fp8 path: one
JSON line per figure with microseconds per call and TFLOP/s (2 M N K per product; GB/s of bytes
read and written for the activation quantization), each product checked against its torch
reference (``max_rel_err``, float32 product of the unquantized activations and the fp8 weight).

Kinds: ``bf16`` (``F.linear``, cuBLAS), ``fp8_path`` (``Fp8Linear.prefill`` as the model calls it:
quantize the activations per row, then the product), its parts ``quant`` (``triton_quant.fp8_rows``)
and ``scaled_mm`` (``torch._scaled_mm`` row-wise, fast accumulation, on quantized activations), and
for comparison ``scaled_mm_exact`` (without fast accumulation) and ``scaled_mm_tensor`` (one scale
per tensor: cuBLAS's kernel). The producers of the rows: ``norm_then_quant`` (the decode kernels'
residual add + RMSNorm, then ``fp8_rows``) against ``norm_quant`` (``fp8_norm_rows``), and
``silu_then_quant`` (SiLU-mul of a [M, 2K] gate_up, then ``fp8_rows``) against ``silu_quant``
(``fp8_silu_mul_rows``), in GB/s of the bytes each moves. Triton E4M3 products (a tiled and a
persistent TMA kernel, commit a4838cc) measured 0.84-0.97x the speed of the row-wise ``_scaled_mm``
on these shapes and were dropped.

Each figure replays a CUDA graph of --calls calls, timed with CUDA events (``gpu_quant_gemv.time_graph``).

    python benchmarks/gpu_quant_prefill.py [--rows 8192] [--shapes 8b.qkv 8b.o 8b.gate_up 8b.down]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_gemv import SHAPES  # noqa: E402
from benchmarks.gpu_quant_gemv import time_graph  # noqa: E402


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((out.float() - ref).abs().max() / ref.abs().max()).item(), 5)


def sweep(name: str, rows: int, calls: int, kinds: set[str]) -> None:
    from trtedge.runtime.artifacts.quantize import quantize_fp8
    from trtedge.runtime.ops import quant_linear, triton_quant
    from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

    n, k = SHAPES[name]
    flop = 2 * rows * n * k
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w16 = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    q = quantize_fp8(w16)
    ref = F.linear(x.float(), q.dequantize())

    def emit(kind, fn, check=True, nbytes=None, **extra):
        if kind.split(":")[0] not in kinds:
            return
        line = {"shape": name, "m": rows, "n": n, "k": k, "kind": kind, **extra}
        try:
            out = fn()
            us = time_graph(fn, calls)
            line["us"] = round(us, 1)
            line["tflops"] = round(flop / us / 1e6, 1)
            if nbytes is not None:
                line["gbps"] = round(nbytes / us / 1e3, 1)
            if check:
                line["max_rel_err"] = _rel_err(out, ref)
        except Exception as e:  # a variant that fails here: the others still run
            line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(line), flush=True)

    emit("bf16", lambda: F.linear(x, w16))
    lin = quant_linear.Fp8Linear(q, None)
    line_path = lin.scaled_mm
    emit("fp8_path", lambda: lin.prefill(x), scaled_mm=line_path)
    quant_bytes = rows * k * 3 + rows * 4
    emit("quant", lambda: triton_quant.fp8_rows(x), check=False, nbytes=quant_bytes)
    xq, sx = triton_quant.fp8_rows(x)
    wt, sw = q.data.t(), q.scale.float().view(1, n)
    emit(
        "scaled_mm",
        lambda: torch._scaled_mm(xq, wt, sx, sw, out_dtype=torch.bfloat16, use_fast_accum=True),
    )
    emit(
        "scaled_mm_exact",
        lambda: torch._scaled_mm(xq, wt, sx, sw, out_dtype=torch.bfloat16, use_fast_accum=False),
    )
    # the producers of an fp8 product's rows: RMSNorm (+ residual add) or SiLU-mul, then the
    # quantization, against the kernels that fuse them (no 16-bit copy written and read back)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    normed, delta = torch.empty_like(x), torch.randn_like(x)
    ops = TritonDecodeKernels()
    emit(
        "norm_then_quant",
        lambda: (ops.add_rms_norm(x, delta, norm_w, normed, 1e-6), triton_quant.fp8_rows(normed)),
        check=False,
        nbytes=rows * k * 11,
    )
    emit(
        "norm_quant",
        lambda: triton_quant.fp8_norm_rows(x, delta, norm_w, 1e-6),
        check=False,
        nbytes=rows * k * 7,
    )
    gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
    act = torch.empty_like(x)
    emit(
        "silu_then_quant",
        lambda: (ops.silu_mul(gate_up, act), triton_quant.fp8_rows(act)),
        check=False,
        nbytes=rows * k * 9,
    )
    emit("silu_quant", lambda: triton_quant.fp8_silu_mul_rows(gate_up), check=False, nbytes=rows * k * 5)
    gate_up = act = normed = delta = None
    one = torch.ones((), device="cuda")
    emit(
        "scaled_mm_tensor",
        lambda: torch._scaled_mm(xq, wt, one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        check=False,
    )


KINDS = (
    "bf16", "fp8_path", "quant", "norm_then_quant", "norm_quant", "silu_then_quant", "silu_quant",
    "scaled_mm", "scaled_mm_exact", "scaled_mm_tensor",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8192, help="prompt tokens (M)")
    parser.add_argument("--shapes", nargs="+", default=["8b.qkv", "8b.o", "8b.gate_up", "8b.down"])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)
    for name in args.shapes:
        sweep(name, args.rows, args.calls, set(args.kinds.split(",")))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
