"""Structured-output overhead on SmolLM2-135M (CPU): greedy decode tokens/s with a JSON-schema guide
against the same prompt unguided, in one run.

    python benchmarks/guided_overhead.py [--rounds 3] [--items 24] [--threads 2]

The unguided request decodes as many tokens as the guided one produced (EOS ignored), so both time the
same number of decode steps on the same prompt. Runs alternate (unguided, guided with the mask fill
overlapping the forward on a worker thread, guided with the fill inline, guided with jump-forward)
for --rounds rounds; the median decode tokens/s of each is reported with its ratio to unguided.
Target: guided >= 0.8x unguided.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtedge import LLM, SamplingParams  # noqa: E402

PROMPT = [{"role": "user", "content": "List some things you might find in a kitchen, as JSON."}]


def schema(items: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "kitchen_items": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "minItems": items,
                "maxItems": items,
            }
        },
        "required": ["kitchen_items"],
    }


def decode(llm: LLM, params: SamplingParams) -> tuple[float, int, int]:
    box = {}
    out = llm.chat(PROMPT, params, on_metrics=lambda m: box.update(m=m))
    m = box["m"]
    return m.decode_tokens_per_second, len(out.token_ids), m.forward_passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=24, help="array length the schema demands")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # in this process: the run switches the guides' overlap on the engine itself
    llm = LLM(max_kv_cache_capacity=2048, max_input_len=512, engine_process=False)
    guide = {"json": schema(args.items)}
    guided = SamplingParams(max_tokens=1500, temperature=0, guided_decoding=guide)
    jump = SamplingParams(max_tokens=1500, temperature=0, guided_decoding={**guide, "jump_forward": True})
    llm.chat(PROMPT, SamplingParams(max_tokens=8, temperature=0, guided_decoding=guide))  # compile, warm up
    _, n, _ = decode(llm, guided)
    plain = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    runs: dict[str, list[float]] = {
        "unguided": [],
        "guided": [],
        "guided, inline fill": [],
        "guided, jump": [],
    }
    passes: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, params, overlap in [
            ("unguided", plain, True),
            ("guided", guided, True),
            ("guided, inline fill", guided, False),
            ("guided, jump", jump, True),
        ]:
            llm.engine.guides.overlap = overlap
            tps, _, passes[name] = decode(llm, params)
            runs[name].append(tps)
    llm.close()
    base = statistics.median(runs["unguided"])
    print(f"SmolLM2-135M, {torch.get_num_threads()} threads, {n} output tokens, greedy, {args.rounds} rounds")
    print(f"{'run':<22}{'decode tok/s':>14}{'x unguided':>12}{'passes':>8}   all rounds")
    for name, values in runs.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name:<22}{median:>14.1f}{median / base:>12.2f}{passes[name]:>8}   {rounds}")


if __name__ == "__main__":
    main()
