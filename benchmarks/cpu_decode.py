"""Batch-1 decode speed of SmolLM2-135M on the CPU: trtedge vs HF transformers, same weights, one run.

    python benchmarks/cpu_decode.py [--tokens 128] [--threads 2]

Both sides greedy-decode the same prompt for --tokens new tokens (EOS ignored). trtedge runs the
embedded GGUF twice: with its default weights (int8 on the CPU for a quantized GGUF) and with
float32 weights; transformers runs the same GGUF dequantized to a float32 HF directory.
Achieved weight bandwidth = bytes of weights read per token x tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny import export_gguf_as_hf  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402
from trtedge.runtime.embedded import embedded_model_path  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def bench_trtedge(weights: str, tokens: int) -> tuple[float, int]:
    with LLM(weights=weights, max_kv_cache_capacity=1024) as llm:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.chat(PROMPT, SamplingParams(max_tokens=8, temperature=0))  # warm-up
        metrics = []
        llm.chat(PROMPT, params, on_metrics=metrics.append)
        return metrics[0].decode_tokens_per_second, llm.model.weight_bytes


def bench_transformers(hf_dir: Path, tokens: int) -> tuple[float, int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with LLM(str(hf_dir), weights="float") as llm:
        ids = torch.tensor([llm.encode_prompt(PROMPT)])
    del tok
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start - prefill
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return (tokens - 1) / elapsed, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for weights in ("auto", "float"):
        tps, nbytes = bench_trtedge(weights, args.tokens)
        rows.append((f"trtedge ({'default' if weights == 'auto' else weights} weights)", tps, nbytes))
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export_gguf_as_hf(embedded_model_path(), Path(tmp) / "smollm2")
        tps, nbytes = bench_transformers(hf_dir, args.tokens)
        rows.append(("HF transformers (float32)", tps, nbytes))
    hf_tps = rows[-1][1]
    print(f"SmolLM2-135M-Instruct, batch 1, {args.tokens} new tokens, {args.threads} threads")
    print(f"{'engine':34} {'decode tok/s':>12} {'weights MiB':>12} {'GB/s':>7} {'vs HF':>7}")
    for name, tps, nbytes in rows:
        print(f"{name:34} {tps:12.1f} {nbytes / 2**20:12.0f} {tps * nbytes / 1e9:7.2f} {tps / hf_tps:6.2f}x")


if __name__ == "__main__":
    main()
