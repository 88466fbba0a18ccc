"""Speculative decoding vs plain decoding, one run, same prompt, greedy.

    python benchmarks/speculative.py                 # CPU: SmolLM2-135M, ngram vs plain, copy-heavy task
    python benchmarks/speculative.py --mode device   # GPU: Qwen3-0.6B-shape target (random weights)
                                                     # with a tiny 2-layer draft, draft_model and ngram vs plain
    python benchmarks/speculative.py --mode device --shape qwen3-8b

Device mode also runs, on the same target, an EAGLE-3 head and a DFlash draft of the published layouts
(random weights at the target's width; DFlash at its default depth, 15 of a block of 16) and the oracle: a test proposer that drafts the tokens the target emitted for the prompt
in its previous run (plain decoding first), so every draft is accepted while outputs agree: the
ceiling of the verify path at k tokens (trtedge.runtime.speculative.oracle; it runs the engine in this
process, so its table has an in-process plain row of its own). Before its timed runs the oracle is
settled (``oracle.settle``): in bf16 a verify step can round a near tie of the random weights the other
way than a plain step, past which an answer learnt from plain decoding drafts nothing (the rest of the
run would decode plainly), so it runs until its output is the answer it drafts from. Then a Qwen3.5-0.8B-style target with one
random MTP layer (``--mtp-layers``; 0 skips it): plain, mtp at its default depth (1) and at k.

The copy-heavy task asks the model to repeat a block of code with one rename, so most of the
answer already sits in the prompt (what prompt lookup is for). Each configuration runs the prompt
once to warm up, then --repeats times; the table shows decode tokens/s (the best run), the
acceptance rate, tokens emitted per verification step, the mean time of a verification step (the
target's forward over the k + 1 nodes and the acceptance) and of a drafting step (with the
proposer's bookkeeping of the verdict: a head keeping the accepted rows' hidden states), each against
one plain decode step (1 / plain tokens/s), and whether the output equals plain decoding.
Device mode has two draft models: the target's own first 2 layers (dummy weights are drawn from one
seed in checkpoint order, so a 2-layer draft of the same width holds exactly those layers and the
target's head: a truncated target that often agrees with it) and a 256-wide 2-layer model that rarely
agrees (its row measures the cost of drafting and verifying alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import (  # noqa: E402
    qwen3_5_config,
    qwen3_config,
    write_agreeing_weights,
    write_config_shape,
    write_shape,
)
from trtedge import LLM, SamplingParams  # noqa: E402
from trtedge.runtime.speculative.oracle import OracleProposer, common_prefix, install, settle  # noqa: E402

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
START = time.perf_counter()
TASK = [
    {
        "role": "user",
        "content": "Repeat this Python function exactly, but rename `values` to `samples`. "
        "Output only the code.\n\n" + CODE,
    }
]


def run(llm: LLM, prompt, tokens: int, repeats: int, after=None, label: str = "") -> dict:
    """``after(output)``: called with each run's RequestOutput (the oracle learns from it); ``label``:
    the row's name in the line printed when it is done."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    runs = []
    for i in range(repeats + 1):
        metrics = []
        out = (
            llm.chat(prompt, params, on_metrics=metrics.append)
            if isinstance(prompt, list) and isinstance(prompt[0], dict)
            else llm.generate(prompt, params, on_metrics=metrics.append)
        )
        if after is not None:
            after(out)
        if i:
            runs.append((metrics[0], out.token_ids))
    best, ids = max(runs, key=lambda r: r[0].decode_tokens_per_second)
    steps = best.spec_steps or 1
    # each row as it finishes: a run cut by its time limit still shows the rows it had
    print(
        f"row done ({label}): {best.decode_tokens_per_second:.1f} tok/s, verify "
        f"{1000 * best.spec_verification_time / steps:.3f} ms, draft {1000 * best.spec_proposal_time / steps:.3f} ms, "
        f"{best.spec_steps} steps, at {time.perf_counter() - START:.0f} s",
        flush=True,
    )
    return {
        "tok_s": best.decode_tokens_per_second,
        "acceptance": best.spec_acceptance_rate,
        "per_step": best.spec_mean_accepted_length,
        "verify_ms": 1000 * best.spec_verification_time / steps,
        "propose_ms": 1000 * best.spec_proposal_time / steps,
        "ids": ids,
    }


def table(title: str, rows: list[tuple[str, dict]]) -> None:
    base = rows[0][1]
    step_ms = 1000 / base["tok_s"]
    print(title)
    print(f"plain decode step: {step_ms:.3f} ms")
    print(
        f"{'configuration':44} {'decode tok/s':>12} {'speedup':>8} {'accepted':>9} {'tok/step':>9} "
        f"{'verify ms':>10} {'/plain':>7} {'draft ms':>9} {'same':>5}"
    )
    for name, r in rows:
        spec = bool(r["per_step"])
        accepted = f"{r['acceptance']:.1%}" if spec else "-"
        per_step = f"{r['per_step']:.2f}" if spec else "-"
        verify = f"{r['verify_ms']:.3f}" if spec else "-"
        ratio = f"{r['verify_ms'] / step_ms:.2f}x" if spec else "-"
        propose = f"{r['propose_ms']:.3f}" if spec else "-"
        same = "yes" if r["ids"] == base["ids"] else "NO"
        print(
            f"{name:44} {r['tok_s']:12.1f} {r['tok_s'] / base['tok_s']:7.2f}x {accepted:>9} {per_step:>9} "
            f"{verify:>10} {ratio:>7} {propose:>9} {same:>5}"
        )
        if not r["ids"] == base["ids"]:
            first = next(
                (i for i, (a, b) in enumerate(zip(r["ids"], base["ids"])) if a != b),
                min(len(r["ids"]), len(base["ids"])),
            )
            print(f"{'':44} first differing token: {first} of {len(base['ids'])}")


def cpu(args) -> None:
    rows = []
    configs = [("plain decode", None)] + [
        (f"ngram, {k} speculative tokens", {"method": "ngram", "num_speculative_tokens": k}) for k in args.k
    ]
    for name, spec in configs:
        with LLM(max_kv_cache_capacity=1024, speculative_config=spec) as llm:
            rows.append((name, run(llm, TASK, args.tokens, args.repeats, label=name)))
    table(f"SmolLM2-135M-Instruct (CPU), copy-heavy task, batch 1, {args.tokens} new tokens", rows)


def device(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = write_shape(Path(tmp) / "target", args.shape)
        # Dummy weights are drawn in checkpoint order from one seed: a draft of the target's width
        # with 2 layers holds exactly the target's embeddings, first 2 layers and head (a truncated
        # target, which agrees with it often); a 256-wide draft of its own rarely agrees.
        drafts = {}
        for name, change in (
            ("first2", dict(num_hidden_layers=2)),
            (
                "tiny",
                dict(
                    hidden_size=256,
                    intermediate_size=768,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                ),
            ),
        ):
            drafts[name] = Path(tmp) / name
            if "draft" not in args.only:
                continue
            write_shape(drafts[name], args.shape)
            (drafts[name] / "config.json").write_text(json.dumps(qwen3_config(args.shape) | change))
        eagle3, dflash = Path(tmp) / "eagle3", Path(tmp) / "dflash"
        if "eagle3" in args.only:
            write_eagle3_head(eagle3, qwen3_config(args.shape))
        if "dflash" in args.only:
            write_dflash_draft(dflash, qwen3_config(args.shape))
        prompt = [int(t) for t in (list(range(1000, 1064)) * 3)]  # a repetitive prompt: lookup finds drafts
        configs = [
            ("plain decode", None),
            (
                f"ngram, {args.k[0]} speculative tokens",
                {"method": "ngram", "num_speculative_tokens": args.k[0]},
            ),
            (
                f"draft_model (target's first 2 layers), {args.k[0]} tokens",
                {
                    "method": "draft_model",
                    "model": str(drafts["first2"]),
                    "num_speculative_tokens": args.k[0],
                },
            ),
            (
                f"draft_model (2-layer 256-wide), {args.k[0]} tokens",
                {"method": "draft_model", "model": str(drafts["tiny"]), "num_speculative_tokens": args.k[0]},
            ),
            (
                f"eagle3 (random head, published layout), {args.k[0]}",
                {"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": args.k[0]},
            ),
            ("dflash (random 2-layer draft, block 16), 15", {"method": "dflash", "model": str(dflash)}),
        ]
        wanted = {"draft_model": "draft"}
        configs = [
            (n, c) for n, c in configs if c is None or wanted.get(c["method"], c["method"]) in args.only
        ]
        rows = []
        for name, spec in configs if len(configs) > 1 else ():
            with LLM(
                str(target),
                load_format="dummy",
                dtype=args.dtype,
                max_kv_cache_capacity=2048,
                speculative_config=spec,
            ) as llm:
                rows.append((name, run(llm, prompt, args.tokens, args.repeats, label=name)))
        if rows:
            table(
                f"{args.shape} shape (random weights, {args.dtype}), batch 1, {args.tokens} new tokens", rows
            )
        load = dict(load_format="dummy", dtype=args.dtype, max_kv_cache_capacity=2048)
        if "oracle" in args.only:
            table(
                f"{args.shape} shape, the oracle (drafts = the target's own greedy tokens), in-process, batch 1",
                oracle_rows(target, load, prompt, args),
            )
        if args.mtp_layers and "mtp" in args.only:
            qwen35 = write_config_shape(Path(tmp) / "qwen3.5", qwen3_5_config(args.mtp_layers))
            rows = []
            for name, spec in (
                ("plain decode", None),
                ("mtp (its default: 1 token)", {"method": "mtp"}),
                (f"mtp, {args.k[0]} tokens", {"method": "mtp", "num_speculative_tokens": args.k[0]}),
            ):
                with LLM(str(qwen35), speculative_config=spec, **load) as llm:
                    rows.append((name, run(llm, prompt, args.tokens, args.repeats, label=name)))
            table(
                f"Qwen3.5-0.8B-style shape, {args.mtp_layers} layers + 1 random MTP layer ({args.dtype}), "
                f"batch 1, {args.tokens} new tokens",
                rows,
            )
        for scale in [s for s in args.agreeing_scale if s > 0] if "agreeing" in args.only else ():
            # a target its own first 2 layers agree with (see write_agreeing_weights): draft_model's gain
            agreeing = write_agreeing_weights(
                write_shape(Path(tmp) / f"agreeing-{scale}", args.shape), args.shape, scale
            )
            first2 = write_shape(Path(tmp) / "agreeing-draft", args.shape)
            (first2 / "config.json").write_text(
                json.dumps(qwen3_config(args.shape) | dict(num_hidden_layers=2))
            )
            write_agreeing_weights(first2, args.shape)  # the same draw: the target's first 2 layers
            rows = []
            for name, spec in (
                ("plain decode", None),
                (
                    f"draft_model (its first 2 layers), {args.k[0]} tokens",
                    {
                        "method": "draft_model",
                        "model": str(first2),
                        "num_speculative_tokens": args.k[0],
                    },
                ),
            ):
                with LLM(
                    str(agreeing), dtype=args.dtype, max_kv_cache_capacity=2048, speculative_config=spec
                ) as llm:
                    rows.append((name, run(llm, prompt, args.tokens, args.repeats, label=name)))
            table(
                f"{args.shape} shape, layers past the 2nd scaled by {scale} "
                f"({args.dtype}), batch 1, {args.tokens} new tokens",
                rows,
            )


def oracle_rows(path, load: dict, prompt, args) -> list[tuple[str, dict]]:
    """Plain decoding, then the oracle at each k, every engine in this process (``install`` needs it)."""
    with LLM(str(path), engine_process=False, **load) as llm:
        plain = run(llm, prompt, args.tokens, args.repeats)
    rows = [("plain decode (in-process)", plain)]
    for k in args.k:
        oracle = OracleProposer()
        oracle.remember(prompt, plain["ids"])
        spec = {"method": "ngram", "num_speculative_tokens": k}  # carries the chain geometry
        with LLM(str(path), engine_process=False, speculative_config=spec, **load) as llm:
            install(llm.engine, oracle)
            params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            runs = settle(llm, prompt, params, oracle)
            kept = []  # per timed run: how many of its tokens follow the answer it drafted from

            def learn(out, oracle=oracle, kept=kept):
                known = oracle.answers.get(tuple(out.prompt_token_ids), [])
                kept.append(common_prefix(out.token_ids, known))
                oracle.remember(out.prompt_token_ids, out.token_ids)

            row = run(llm, prompt, args.tokens, args.repeats, learn)
            state = (
                f"settled in {runs} runs"
                if runs
                else f"not settled: kept its answer {min(kept)}/{args.tokens}"
            )
            rows.append((f"oracle, {k} tokens ({state})", row))
    return rows


def write_eagle3_head(directory: Path, target: dict, draft_vocab: int = 32000) -> Path:
    """A random EAGLE-3 head in the published layout at the target's width (one decoder layer of the
    target's geometry over [embed, fc(3 taps)], a 32k draft vocabulary mapped to the first target ids)."""
    import torch
    from safetensors.torch import save_file

    h, layers = target["hidden_size"], target["num_hidden_layers"]
    q = target["num_attention_heads"] * target["head_dim"]
    kv = target["num_key_value_heads"] * target["head_dim"]
    inter = target["intermediate_size"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    m = "midlayer."
    t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
    t2d[:draft_vocab] = True
    tensors = {
        "fc.weight": rand(h, 3 * h),
        f"{m}input_layernorm.weight": ones(h),
        f"{m}hidden_norm.weight": ones(h),
        f"{m}post_attention_layernorm.weight": ones(h),
        f"{m}self_attn.q_proj.weight": rand(q, 2 * h),
        f"{m}self_attn.k_proj.weight": rand(kv, 2 * h),
        f"{m}self_attn.v_proj.weight": rand(kv, 2 * h),
        f"{m}self_attn.o_proj.weight": rand(h, q),
        f"{m}mlp.gate_proj.weight": rand(inter, h),
        f"{m}mlp.up_proj.weight": rand(inter, h),
        f"{m}mlp.down_proj.weight": rand(h, inter),
        "norm.weight": ones(h),
        "lm_head.weight": rand(draft_vocab, h),
        "d2t": torch.zeros(draft_vocab, dtype=torch.long),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "target_hidden_size": h,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target.get("rope_theta", 10000.0),
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sorted({min(2, layers - 1), layers // 2, max(layers - 3, 0)})
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_dflash_draft(directory: Path, target: dict, num_layers: int = 2, block_size: int = 16) -> Path:
    """A random DFlash draft in the published layout at the target's width: ``num_layers`` Qwen3 layers
    of the target's geometry, fc over the outputs of 5 target layers spread over its depth."""
    import torch
    from safetensors.torch import save_file

    h, layers = target["hidden_size"], target["num_hidden_layers"]
    q = target["num_attention_heads"] * target["head_dim"]
    kv = target["num_key_value_heads"] * target["head_dim"]
    inter, hd = target["intermediate_size"], target["head_dim"]
    taps = [1 + i * (layers - 3) // 4 for i in range(5)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"fc.weight": rand(h, len(taps) * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors |= {
            f"{p}self_attn.q_proj.weight": rand(q, h),
            f"{p}self_attn.k_proj.weight": rand(kv, h),
            f"{p}self_attn.v_proj.weight": rand(kv, h),
            f"{p}self_attn.o_proj.weight": rand(h, q),
            f"{p}self_attn.q_norm.weight": ones(hd),
            f"{p}self_attn.k_norm.weight": ones(hd),
            f"{p}input_layernorm.weight": ones(h),
            f"{p}post_attention_layernorm.weight": ones(h),
            f"{p}mlp.gate_proj.weight": rand(inter, h),
            f"{p}mlp.up_proj.weight": rand(inter, h),
            f"{p}mlp.down_proj.weight": rand(h, inter),
        }
    config = {
        key: target[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "vocab_size",
        )
    } | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": num_layers,
        "dflash_config": {
            "target_layer_ids": taps,
            "block_size": block_size,
            "mask_token_id": target["vocab_size"] - 1,
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("cpu", "device"), default="cpu")
    parser.add_argument(
        "--shape", default="qwen3-0.6b", help="device mode: the target's shape (benchmarks/shapes.py)"
    )
    parser.add_argument("--dtype", default="bfloat16", help="device mode: bfloat16 or float32")
    parser.add_argument(
        "--agreeing-scale",
        type=float,
        nargs="+",
        default=[0.1],
        help="device mode: also run draft_model on a target whose layers past the 2nd are scaled by this "
        "(its first 2 layers, the draft, agree with it often; smaller agrees more); 0 skips it",
    )
    parser.add_argument(
        "--only",
        type=lambda v: set(v.split(",")),
        default={"ngram", "draft", "eagle3", "dflash", "oracle", "mtp", "agreeing"},
        help="device mode: the rows to run besides plain decoding, comma-separated among ngram, draft, eagle3, "
        "dflash, oracle, mtp, agreeing (default: all)",
    )
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=24,
        help="device mode: layers of the Qwen3.5-style target whose MTP layer is measured; 0 skips it",
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="num_speculative_tokens to try")
    args = parser.parse_args()
    cpu(args) if args.mode == "cpu" else device(args)


if __name__ == "__main__":
    main()
