"""Greedy text of the int4 bundle (native kernels) vs the same weights dequantized, on 5 prompts.

    python benchmarks/cpu_quality.py [--tokens 16] [--model PATH]

The int4 kernels quantize activations to int16 per group of 32. The references run the same int4
bundle dequantized at load: to bfloat16 weights (`--dtype bfloat16`: on the CPU activations stay
float32, each product rounds its inputs to bfloat16 and sums in float32) and to float32 weights with
torch operations. Prints, per prompt, how many of the first --tokens greedy tokens agree and both
texts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtedge import LLM, SamplingParams  # noqa: E402
from trtedge.runtime import models  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers greater than 10.",
    "How do I reverse a list in Python?",
]


def greedy(tokens: int, model: str | None, **kwargs) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    with LLM(model, weights="int4", max_kv_cache_capacity=512, **kwargs) as llm:
        return [llm.chat([{"role": "user", "content": p}], params).outputs[0].token_ids for p in PROMPTS]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    native = greedy(args.tokens, args.model)
    bf16 = greedy(args.tokens, args.model, dtype="bfloat16")
    models.native_quantized = lambda device, dtype: False  # same bundle, dequantized to float32 at load
    fp32 = greedy(args.tokens, args.model)
    with LLM(args.model, weights="int4", max_kv_cache_capacity=512) as llm:
        decode = llm.tokenizer.decode
    for name, reference in (("dequantized bf16", bf16), ("dequantized fp32", fp32)):
        same = 0
        print(f"int4 native vs {name}:")
        for prompt, a, b in zip(PROMPTS, native, reference):
            agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            same += agree >= args.tokens
            print(
                f"  {agree:2d}/{args.tokens} {prompt!r}\n     int4: {decode(a)!r}\n     ref:  {decode(b)!r}"
            )
        print(f"  identical for all {args.tokens} tokens on {same} of {len(PROMPTS)} prompts")


if __name__ == "__main__":
    main()
