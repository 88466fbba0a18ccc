"""Greedy quality of quantized weights on 5 prompts: the CPU int4 kernels, or the GPU modes.

    python benchmarks/cpu_quality.py [--tokens 16] [--model PATH]
    python benchmarks/cpu_quality.py --device cuda [--weights fp8,int4] [--kv-cache-dtype fp8] [--positions 256]
                                     [--model PATH]

CPU (the default): the int4 kernels quantize activations to int16 per group of 32. The references run
the same int4 bundle dequantized at load: to bfloat16 weights (`--dtype bfloat16`: on the CPU
activations stay float32, each product rounds its inputs to bfloat16 and sums in float32) and to
float32 weights with torch operations. Prints, per prompt, how many of the first --tokens greedy
tokens agree and both texts.

CUDA (`--device cuda`): each of --weights (fp8, int4, int8) against the bf16 weights of the same model:
greedy continuation equal for --tokens tokens on how many of the 5 prompts, and top-1 agreement over
--positions positions (each mode teacher-forced through the bf16 continuation: the share of
positions where its most likely token is bf16's greedy one). The issue's bar: >= 4 of 5 prompts, >= 95%.
``--kv-cache-dtype fp8`` runs the compared modes with the fp8 KV cache (``--weights bf16`` measures it
alone), the reference keeping a bf16 one.
"""

from __future__ import annotations

import argparse
import json
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


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cpu(args) -> None:
    native = greedy(args.tokens, args.model)
    bf16 = greedy(args.tokens, args.model, dtype="bfloat16")
    models.native_quantized = lambda device, dtype: False  # same bundle, dequantized to float32 at load
    fp32 = greedy(args.tokens, args.model)
    with LLM(args.model, weights="int4", max_kv_cache_capacity=512) as llm:
        decode = llm.detokenize
    for name, reference in (("dequantized bf16", bf16), ("dequantized fp32", fp32)):
        same = 0
        print(f"int4 native vs {name}:")
        for prompt, a, b in zip(PROMPTS, native, reference):
            agree = agreement(a, b)
            same += agree >= args.tokens
            print(
                f"  {agree:2d}/{args.tokens} {prompt!r}\n     int4: {decode(a)!r}\n     ref:  {decode(b)!r}"
            )
        print(f"  identical for all {args.tokens} tokens on {same} of {len(PROMPTS)} prompts")


def gpu_mode(
    model,
    device: str,
    weights: str,
    prompts: list[list[int]],
    continuations: list[list[int]] | None,
    tokens: int,
    kv_cache_dtype: str = "auto",
):
    """(greedy continuations of ``tokens``, top-1 hits over ``continuations`` teacher-forced, positions)."""
    options = dict(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        weights=weights,
        kv_cache_dtype=kv_cache_dtype,
        max_kv_cache_capacity=1024,
        max_input_len=768,
    )
    hits = positions = 0
    with LLM(model, **options) as llm:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        outs = [llm.generate(p, params).token_ids for p in prompts]
        for prompt, cont in zip(prompts, continuations or []):
            forced = llm.generate(
                prompt + cont, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
            )
            infos = forced.prompt_logprobs[len(prompt) :]
            hits += sum(info.rank == 1 for info in infos)
            positions += len(infos)
        decode = llm.detokenize
    return outs, hits, positions, decode


def gpu(args) -> None:
    with LLM(args.model, device=args.device, weights="bf16", max_kv_cache_capacity=1024) as llm:
        prompts = [llm.render_chat([{"role": "user", "content": p}]).ids for p in PROMPTS]
    per_prompt = -(-args.positions // len(PROMPTS))
    long_ref, _, _, decode = gpu_mode(
        args.model, args.device, "bf16", prompts, None, max(per_prompt, args.tokens)
    )
    reference = [c[: args.tokens] for c in long_ref]
    continuations = [c[:per_prompt] for c in long_ref]
    for weights in args.weights.split(","):
        outs, hits, positions, _ = gpu_mode(
            args.model, args.device, weights, prompts, continuations, args.tokens, args.kv_cache_dtype
        )
        same = sum(agreement(a, b) >= args.tokens for a, b in zip(outs, reference))
        for prompt, a, b in zip(PROMPTS, outs, reference):
            print(
                f"  {weights} {agreement(a, b):2d}/{args.tokens} {prompt!r}\n     {weights}: {decode(a)!r}\n     bf16: {decode(b)!r}"
            )
        row = dict(
            figure="quality",
            device=args.device,
            weights=weights,
            kv_cache_dtype=args.kv_cache_dtype,
            greedy_equal_prompts=f"{same}/{len(PROMPTS)}",
            top1_agreement=round(hits / max(positions, 1), 4),
            positions=positions,
        )
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--weights", default="fp8,int4", help="cuda: the modes compared with bf16")
    parser.add_argument("--positions", type=int, default=256, help="cuda: teacher-forced positions in all")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="cuda: the compared modes' KV cache (fp8: against a bf16 one)",
    )
    parser.add_argument(
        "--compare", action="store_true", help="the CUDA check (--weights vs bf16) on --device cpu"
    )
    args = parser.parse_args()
    gpu(args) if args.device == "cuda" or args.compare else cpu(args)


if __name__ == "__main__":
    main()
