"""Decode tokens/s of one model shape at tensor-parallel size 1 and N, in one run, and their ratio.

    python benchmarks/tensor_parallel.py [--shape qwen3-8b] [--tp 2] [--batch 1,8] [--new-tokens 256]

Random bf16 weights (load_format="dummy"), a 128-token prompt per request, greedy, EOS ignored, on
CUDA (NCCL; NVLink multicast off). TP=1 is measured twice: with its decode CUDA graphs and eager, since
TP>1 runs eager (graphs do not capture the collectives yet). Prints one JSON line per figure.
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
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.tp:
        sys.exit(f"needs {args.tp} CUDA devices, found {torch.cuda.device_count()}")
    device = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_shape(Path(tmp) / args.shape, args.shape)
        for batch in (int(b) for b in args.batch.split(",")):
            row = dict(figure="decode_tokens_per_s", shape=args.shape, batch=batch, device=device)
            graphs = decode_tps(directory, 1, batch, args.new_tokens, eager=False)
            eager = decode_tps(directory, 1, batch, args.new_tokens, eager=True)
            split = decode_tps(directory, args.tp, batch, args.new_tokens, eager=True)
            print(
                json.dumps(
                    {
                        **row,
                        "tp1_graphs": round(graphs, 1),
                        "tp1_eager": round(eager, 1),
                        f"tp{args.tp}": round(split, 1),
                        f"ratio_tp{args.tp}_vs_tp1_graphs": round(split / graphs, 2),
                        f"ratio_tp{args.tp}_vs_tp1_eager": round(split / eager, 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
