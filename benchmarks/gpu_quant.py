"""Quantized weights on a GPU: bf16 vs fp8 vs int4, batch-1 decode and long-prompt prefill, one run.

    python benchmarks/gpu_quant.py [--shape qwen3-8b] [--weights bf16,fp8,int4] [--new-tokens 256]
                                   [--prefill-len 8192] [--prefill-weights bf16,fp8,int4] [--no-prefill]
                                   [--in-process] [--quick-tune] [--profile]

Random weights (load_format="dummy", quantized on the GPU at load for fp8 / int4) with Qwen3 shapes,
a 128-token prompt, greedy, EOS ignored; one load per mode measures its decode and (for the modes
of --prefill-weights) its prefill. One JSON line per figure: decode tokens/s with the bytes of
weights read per token and the bandwidth that achieves (H200 peak 4.8 TB/s), prefill tokens/s and
its ratio to bf16's in the same run; a last line sets the figures beside the issue's targets.
For a short lease: --in-process keeps the engine core in this process (no child process started per
mode), --quick-tune lets each quantized weight time 5 tilings instead of its whole table (fewer
kernels to compile; the rows say which). --profile adds, per mode, the kernels with the most device
time in 32 decode steps and in one prefill (torch profiler, engine core in-process).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import write_shape  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


# --quick-tune: the tilings each quantized weight times, so that a short lease compiles a few kernels
# per format: for batch-1 decode the one-row products that won on the 8B shapes in
# benchmarks/gpu_quant_gemv.py (variant 3 = GEMV, 4 = GEMV_FMA), and two of the tensor-core tilings
# for the graphs of several rows
QUICK_W8 = (
    (64, 256, 1, 4, 3),
    (64, 256, 4, 4, 3),
    (32, 256, 4, 4, 4),
    (32, 256, 4, 4, 0),
    (64, 256, 1, 4, 0),
)
QUICK_INT4 = (
    (64, 256, 1, 4, 3),
    (64, 256, 4, 4, 3),
    (32, 256, 4, 4, 3),
    (32, 256, 8, 4, 0),
    (32, 256, 4, 4, 1),
)


def quick_tune() -> None:
    from trtedge.runtime.ops import quant_linear, triton_quant

    triton_quant.W8_CANDIDATES, triton_quant.INT4_CANDIDATES = QUICK_W8, QUICK_INT4
    for cls, table in ((quant_linear.Fp8Linear, QUICK_W8), (quant_linear.Int8CudaLinear, QUICK_W8)):
        cls.table = table
    quant_linear.Int4CudaLinear.table = QUICK_INT4


def top_kernels(run, count: int = 12) -> list[list]:
    """[name, total ms, calls] of the ``count`` kernels with the most device time while ``run()``
    runs (torch profiler; the engine core must be in this process)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return [[e.key[:80], round(e.device_time_total / 1e3, 3), e.count] for e in rows[:count]]


def measure(
    directory: Path,
    weights: str,
    prompt: list[int],
    new_tokens: int,
    prefill_len: int,
    in_process: bool,
    profile: bool = False,
) -> dict:
    """One load of ``weights``: batch-1 decode tokens/s, then (``prefill_len`` > 0) the prefill of
    ``prefill_len`` tokens sharing no prefix with anything before it. ``profile``: also the top
    kernels of 32 decode steps and of the prefill."""
    length = max(prefill_len, 512)
    with LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        weights=weights,
        max_kv_cache_capacity=length + 16,
        max_input_len=length,
        max_num_batched_tokens=length,
        engine_process=False if in_process else None,
    ) as llm:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
        metrics = []
        llm.generate(prompt, params, on_metrics=metrics.append)
        result = {
            "decode": metrics[0].decode_tokens_per_second,
            "weight_bytes": llm.describe()["weight_bytes"],
        }
        if profile:
            short = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
            result["decode_kernels"] = top_kernels(lambda: llm.generate(prompt, short))
        if prefill_len:
            warm, long = (
                torch.randint(
                    10, 150000, (prefill_len,), generator=torch.Generator().manual_seed(seed)
                ).tolist()
                for seed in (1, 2)
            )
            llm.generate(warm, SamplingParams(max_tokens=1))  # warm-up at full length
            metrics = []
            llm.generate(long, SamplingParams(max_tokens=1), on_metrics=metrics.append)
            result["prefill"] = prefill_len / metrics[0].prefill_time
            if profile:
                third = torch.randint(10, 150000, (prefill_len,), generator=torch.Generator().manual_seed(3))
                result["prefill_kernels"] = top_kernels(
                    lambda: llm.generate(third.tolist(), SamplingParams(max_tokens=1))
                )
        return result


# The targets on an H200 (Qwen3-8B shape): batch-1 decode tokens/s, prefill ratio to bf16.
TARGETS = {"fp8": 450.0, "int4": 700.0}
PREFILL_TARGET = {"fp8": 1.5}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--weights", default="bf16,fp8,int4")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--prefill-weights", default="bf16,fp8,int4", help="modes whose prefill is measured")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="the engine core in this process (no child to start per mode)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also the top kernels of 32 decode steps and of the prefill per mode (implies --in-process)",
    )
    parser.add_argument(
        "--quick-tune",
        action="store_true",
        help="quantized weights time 5 tilings each instead of the whole tables (implies --in-process)",
    )
    args = parser.parse_args()
    if args.quick_tune:
        args.in_process = True
        quick_tune()
    if args.profile:
        args.in_process = True
    prompt = torch.randint(10, 150000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    device = torch.cuda.get_device_name(0)
    prefill_modes = set() if args.no_prefill else set(args.prefill_weights.split(","))
    decodes: dict[str, float] = {}
    prefills: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_shape(Path(tmp) / args.shape, args.shape)
        for weights in args.weights.split(","):
            length = args.prefill_len if weights in prefill_modes else 0
            try:
                result = measure(
                    directory, weights, prompt, args.new_tokens, length, args.in_process, args.profile
                )
            except Exception as e:  # report, keep going with the other modes
                emit(
                    figure="batch1_decode",
                    weights=weights,
                    shape=args.shape,
                    error=f"{type(e).__name__}: {e}"[:300],
                )
                continue
            tps, nbytes = result["decode"], result["weight_bytes"]
            decodes[weights] = tps
            gbs = tps * nbytes / 1e9
            emit(
                figure="batch1_decode",
                engine="trtedge",
                weights=weights,
                shape=args.shape,
                device=device,
                tokens_per_s=round(tps, 1),
                weight_gb=round(nbytes / 1e9, 3),
                achieved_gb_s=round(gbs, 1),
                pct_of_peak=round(100 * gbs * 1e9 / PEAK_BYTES_PER_S, 1),
                limit_tokens_per_s=round(PEAK_BYTES_PER_S / nbytes, 1),
                tune="quick" if args.quick_tune else "all",
                engine_process=not args.in_process,
            )
            for key in ("decode_kernels", "prefill_kernels"):
                if key in result:
                    emit(figure=key, weights=weights, shape=args.shape, top=result[key])
            if "prefill" not in result:
                continue
            prefills[weights] = result["prefill"]
            row = dict(figure="prefill", engine="trtedge", weights=weights, shape=args.shape)
            row.update(prompt_tokens=args.prefill_len, tokens_per_s=round(prefills[weights], 1))
            if "bf16" in prefills and weights != "bf16":
                row["vs_bf16"] = round(prefills[weights] / prefills["bf16"], 2)
            emit(**row)
    targets = {
        f"decode_{w}": [round(decodes[w], 1), t, decodes[w] >= t] for w, t in TARGETS.items() if w in decodes
    }
    for w, ratio in PREFILL_TARGET.items():
        if w in prefills and "bf16" in prefills:
            got = prefills[w] / prefills["bf16"]
            targets[f"prefill_{w}_vs_bf16"] = [round(got, 2), ratio, got >= ratio]
    emit(figure="targets", shape=args.shape, note="[measured, target, met]", **targets)


if __name__ == "__main__":
    main()
