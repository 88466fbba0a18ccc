"""Speculative decoding vs plain decoding, one run, same prompt, greedy.

    python benchmarks/speculative.py                 # CPU: SmolLM2-135M, ngram vs plain, copy-heavy task
    python benchmarks/speculative.py --mode device   # GPU: Qwen3-0.6B-shape target (random weights)
                                                     # with a tiny 2-layer draft, draft_model and ngram vs plain

The copy-heavy task asks the model to repeat a block of code with one rename, so most of the
answer already sits in the prompt (what prompt lookup is for). Each configuration runs the prompt
once to warm up, then --repeats times; the table shows decode tokens/s (the best run), the
acceptance rate, tokens emitted per verification step and whether the output equals plain decoding.
With random weights (device mode) the draft model is rarely right: that row measures the cost of
drafting and verifying, not a trained draft's gain.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import qwen3_config, write_shape  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402

CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i + 1 >= window:
            out.append(total / window)
    return out
"""
TASK = [
    {
        "role": "user",
        "content": "Repeat this Python function exactly, but rename `values` to `samples`. "
        "Output only the code.\n\n" + CODE,
    }
]


def run(llm: LLM, prompt, tokens: int, repeats: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    runs = []
    for i in range(repeats + 1):
        metrics = []
        out = (
            llm.chat(prompt, params, on_metrics=metrics.append)
            if isinstance(prompt, list) and isinstance(prompt[0], dict)
            else llm.generate(prompt, params, on_metrics=metrics.append)
        )
        if i:
            runs.append((metrics[0], out.token_ids))
    best, ids = max(runs, key=lambda r: r[0].decode_tokens_per_second)
    return {
        "tok_s": best.decode_tokens_per_second,
        "acceptance": best.spec_acceptance_rate,
        "per_step": best.spec_mean_accepted_length,
        "ids": ids,
    }


def table(title: str, rows: list[tuple[str, dict]]) -> None:
    base = rows[0][1]
    print(title)
    print(
        f"{'configuration':44} {'decode tok/s':>12} {'speedup':>8} {'accepted':>9} {'tok/step':>9} {'same':>5}"
    )
    for name, r in rows:
        accepted = f"{r['acceptance']:.1%}" if r["per_step"] else "-"
        per_step = f"{r['per_step']:.2f}" if r["per_step"] else "-"
        same = "yes" if r["ids"] == base["ids"] else "NO"
        print(
            f"{name:44} {r['tok_s']:12.1f} {r['tok_s'] / base['tok_s']:7.2f}x {accepted:>9} {per_step:>9} {same:>5}"
        )


def cpu(args) -> None:
    rows = []
    configs = [("plain decode", None)] + [
        (f"ngram, {k} speculative tokens", {"method": "ngram", "num_speculative_tokens": k}) for k in args.k
    ]
    for name, spec in configs:
        with LLM(max_kv_cache_capacity=1024, speculative_config=spec) as llm:
            rows.append((name, run(llm, TASK, args.tokens, args.repeats)))
    table(f"SmolLM2-135M-Instruct (CPU), copy-heavy task, batch 1, {args.tokens} new tokens", rows)


def device(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = write_shape(Path(tmp) / "target", "qwen3-0.6b")
        draft = Path(tmp) / "draft"
        write_shape(draft, "qwen3-0.6b")
        small = qwen3_config("qwen3-0.6b") | dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        (draft / "config.json").write_text(json.dumps(small))
        prompt = [int(t) for t in (list(range(1000, 1064)) * 3)]  # a repetitive prompt: lookup finds drafts
        configs = [
            ("plain decode", None),
            (
                f"ngram, {args.k[0]} speculative tokens",
                {"method": "ngram", "num_speculative_tokens": args.k[0]},
            ),
            (
                f"draft_model (2-layer 256-wide), {args.k[0]} tokens",
                {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k[0]},
            ),
        ]
        rows = []
        for name, spec in configs:
            with LLM(
                str(target), load_format="dummy", max_kv_cache_capacity=2048, speculative_config=spec
            ) as llm:
                rows.append((name, run(llm, prompt, args.tokens, args.repeats)))
    table(f"Qwen3-0.6B shape (random weights), batch 1, {args.tokens} new tokens", rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("cpu", "device"), default="cpu")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="num_speculative_tokens to try")
    args = parser.parse_args()
    cpu(args) if args.mode == "cpu" else device(args)


if __name__ == "__main__":
    main()
