"""Engine throughput on SmolLM2-135M (CPU): in-flight batching vs one request at a time, in one run.

    python benchmarks/engine_throughput.py [--requests 64] [--batch-size 16] [--seed 0] [--no-reuse]

The same workload runs twice: --requests prompts of random length (--min-prompt..--max-prompt tokens
of text, as chats) with random output lengths (--min-output..--max-output tokens, EOS ignored),
all submitted at once. First with `enable_in_flight_batching=False` (the engine serves them one at a
time, in arrival order), then with `enable_in_flight_batching=True, max_batch_size=--batch-size`.
Output tokens/s = all generated tokens / wall time from the first submission to the last token.

Then, unless --no-reuse: time to first token of a ~1,000-token prompt whose prefix another request
has just computed, with context reuse off and on.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtedge import LLM, SamplingParams  # noqa: E402

WORDS = (
    "the lighthouse keeper walked along the shore at dawn counting ships and gulls while the wind "
    "carried salt and stories from distant harbours where old sailors argued about maps tides and stars"
).split()


def workload(args) -> list[tuple[list[dict], SamplingParams]]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(args.min_prompt, args.max_prompt)))
        messages = [{"role": "user", "content": f"Request {i}: continue this story. {words}"}]
        params = SamplingParams(
            max_tokens=rng.randint(args.min_output, args.max_output), temperature=0, ignore_eos=True
        )
        jobs.append((messages, params))
    return jobs


def run(llm: LLM, jobs) -> dict:
    metrics = []
    lock = threading.Lock()

    def record(m):
        with lock:
            metrics.append(m)

    start = time.perf_counter()
    streams = [llm.generate_stream(m, p, on_metrics=record) for m, p in jobs]
    tokens = sum(len(d.token_ids) for s in streams for d in s)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    ttft = sorted(m.time_to_first_token for m in metrics)
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tok_s": tokens / elapsed,
        "ttft_p50": ttft[len(ttft) // 2],
        "joined": stats["joined_mid_flight"],
        "steps": stats["steps"],
    }


def bench_batching(args) -> None:
    jobs = workload(args)
    options = dict(max_kv_cache_capacity=1024, max_input_len=512)
    results = {}
    for name, ifb in (("one at a time", False), (f"in-flight batch {args.batch_size}", True)):
        with LLM(enable_in_flight_batching=ifb, max_batch_size=args.batch_size, **options) as llm:
            llm.generate([1, 2, 3], SamplingParams(max_tokens=4))  # warm-up
            results[name] = run(llm, jobs)
    print(
        f"\n{args.requests} requests, output {args.min_output}-{args.max_output} tokens, "
        f"prompt {args.min_prompt}-{args.max_prompt} words, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'mode':<22}{'out tokens':>11}{'seconds':>9}{'tok/s':>9}{'TTFT p50':>10}{'steps':>7}{'joined':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<22}{r['tokens']:>11}{r['seconds']:>9.1f}{r['tok_s']:>9.1f}{r['ttft_p50']:>9.2f}s"
            f"{r['steps']:>7}{r['joined']:>8}"
        )
    base, ifb = results.values()
    print(f"speed-up: {ifb['tok_s'] / base['tok_s']:.1f}x")


def bench_reuse() -> None:
    facts = " ".join(
        f"Fact {i}: lighthouse {i} stands on island {i * 7 % 13} and is painted "
        f"{['red', 'blue', 'green', 'white'][i % 4]}."
        for i in range(54)
    )

    def chat(question):
        return [
            {"role": "system", "content": "You answer questions about lighthouses. " + facts},
            {"role": "user", "content": question},
        ]

    with LLM(max_kv_cache_capacity=2048, max_input_len=1200, context_cache_config={"enabled": True}) as llm:
        params = SamplingParams(max_tokens=8, temperature=0)
        cold = llm.chat(
            chat("Where is lighthouse 5?"), SamplingParams(max_tokens=8, temperature=0, reuse_context=False)
        )
        llm.chat(chat("What color is lighthouse 3?"), params)
        warm = llm.chat(chat("Where is lighthouse 5?"), params)
        print(
            f"\ncontext reuse, {cold.prompt_tokens}-token prompt: TTFT {cold.metrics.time_to_first_token:.3f}s "
            f"without reuse, {warm.metrics.time_to_first_token:.3f}s reusing {warm.metrics.reused_tokens} "
            f"tokens; same output: {cold.token_ids == warm.token_ids}"
        )
        print(f"context cache: {llm.get_context_cache_metrics().to_dict()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=120)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reuse", action="store_true")
    args = parser.parse_args()
    bench_batching(args)
    if not args.no_reuse:
        bench_reuse()


if __name__ == "__main__":
    main()
