"""Decode tokens/s of one model shape at tensor-parallel size 1, 2 and 4 side by side, in one run.

    python benchmarks/tensor_parallel.py [--shape qwen3-8b] [--tp 2,4] [--batch 1,8] [--new-tokens 256]
                                         [--eager]

Random bf16 weights (load_format="dummy"), a 128-token prompt per request, greedy, EOS ignored, on
CUDA (NCCL; NVLink multicast off). Every size runs its decode steps through CUDA graphs (with the
all-reduces inside); TP=1 is also measured eagerly, and ``--eager`` adds each TP=N eagerly. A size
needing more GPUs than the machine has is reported as skipped. Prints one JSON line per batch, then
one line setting the figures beside the issue's targets (TP=2 >= 1.5x TP=1 with graphs at batch 1
and 8, TP=4 >= 2.2x at batch 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import write_shape  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402


def decode_tps(directory: Path, tp: int, batch: int, new_tokens: int, eager: bool) -> float:
    prompts = [
        torch.randint(10, 150000, (128,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(batch)
    ]
    llm = LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        tensor_parallel_size=tp,
        max_batch_size=batch,
        enable_in_flight_batching=batch > 1,
        max_kv_cache_capacity=1024,
        max_input_len=512,
        enforce_eager=eager,
    )
    try:
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
        metrics = []
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, on_metrics=metrics.append)
        return sum(m.decode_tokens_per_second for m in metrics)
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--tp", default="2,4", help="tensor-parallel sizes beside TP=1")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--eager", action="store_true", help="also measure each TP=N eagerly")
    args = parser.parse_args()
    sizes = [int(n) for n in args.tp.split(",")]
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("needs a CUDA device")
    device = torch.cuda.get_device_name(0)
    ratios: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_shape(Path(tmp) / args.shape, args.shape)
        for batch in (int(b) for b in args.batch.split(",")):
            row = dict(figure="decode_tokens_per_s", shape=args.shape, batch=batch, device=device, gpus=gpus)
            graphs = decode_tps(directory, 1, batch, args.new_tokens, eager=False)
            row.update(tp1_graphs=round(graphs, 1))
            row.update(tp1_eager=round(decode_tps(directory, 1, batch, args.new_tokens, eager=True), 1))
            for n in sizes:
                if n > gpus:
                    row[f"tp{n}"] = f"skipped: needs {n} GPUs"
                    continue
                split = decode_tps(directory, n, batch, args.new_tokens, eager=False)
                ratios[(n, batch)] = split / graphs
                row.update(
                    {f"tp{n}": round(split, 1), f"ratio_tp{n}_vs_tp1_graphs": round(split / graphs, 2)}
                )
                if args.eager:
                    row[f"tp{n}_eager"] = round(
                        decode_tps(directory, n, batch, args.new_tokens, eager=True), 1
                    )
            print(json.dumps(row), flush=True)
    targets = {(2, 1): 1.5, (4, 1): 2.2, (2, 8): 1.5}
    summary = {
        f"tp{n}_batch{b}_vs_tp1_graphs": (
            f"{ratios[(n, b)]:.2f}x (target >= {t}x)"
            if (n, b) in ratios
            else f"not measured (target >= {t}x)"
        )
        for (n, b), t in targets.items()
    }
    print(json.dumps({"figure": "targets", **summary}), flush=True)


if __name__ == "__main__":
    main()
