"""Where a speculative verify step's time goes, per method, at batch 1: the figure
``benchmarks/speculative.py`` prints (verify ms over a plain step), then the verify span split into its
parts (host staging and the target forward, the acceptance, the commit, the proposer's bookkeeping),
the pure replay time of each captured decode graph (1 row = a plain step's forward, k + 1 rows = a
verify step's), and the torch profiler's tables over a few steps. For the note when the verify
target (<= 1.3x a plain step) is missed.

    python benchmarks/gpu_verify_profile.py --methods plain,ngram,eagle3 [--shape qwen3-0.6b]
    python benchmarks/gpu_verify_profile.py --methods dflash,draft
    python benchmarks/gpu_verify_profile.py --methods mtp        # a Qwen3.5-style target, its own plain row

Every engine runs in this process (the wrappers reach its decoder). ``plain`` is the plain engine
(asynchronous scheduling, as the benchmark's plain row); ``draft`` is the target's first 2 layers;
eagle3 / dflash the random heads of ``benchmarks/speculative.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import qwen3_5_config, qwen3_config, write_config_shape, write_shape  # noqa: E402
from benchmarks.speculative import run, write_dflash_draft, write_eagle3_head  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402

PROMPT = [int(t) for t in (list(range(1000, 1064)) * 3)]  # the benchmark's repetitive prompt


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Spans:
    """Wall time of named spans, each closed after the device finished its work (sync at both ends)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.count = defaultdict(int)
        self.enabled = False

    def wrap(self, name: str, fn, launch_name: str | None = None):
        def wrapped(*a, **k):
            if not self.enabled:
                return fn(*a, **k)
            sync()
            start = time.perf_counter()
            with torch.profiler.record_function(name):
                out = fn(*a, **k)
            if launch_name:  # the host's share: until the call returned, before waiting for the device
                self.total[launch_name] += time.perf_counter() - start
                self.count[launch_name] += 1
            sync()
            self.total[name] += time.perf_counter() - start
            self.count[name] += 1
            return out

        return wrapped

    def report(self, steps: int) -> dict:
        return {name: round(1000 * t / max(steps, 1), 4) for name, t in sorted(self.total.items())}


def instrument(llm) -> tuple[Spans, callable]:
    dec = llm.engine.speculative
    spans = Spans()
    dec._score = spans.wrap("verify.score (stage + target forward)", dec._score, "verify.score host launch")
    dec._commit = spans.wrap("verify.commit (blocks, rollback)", dec._commit)
    proposer = dec.proposer
    proposer.verified = spans.wrap("verify.proposer.verified (taps kept)", proposer.verified)
    proposer.propose = spans.wrap("propose", proposer.propose)
    step = dec.step

    def counted(batch):
        before = dec.stats.steps
        out = step(batch)
        spans.count["steps"] += dec.stats.steps - before
        return out

    dec.step = counted
    return spans, dec


class GcClock:
    """Time the interpreter spends in garbage collection, by generation, inside a speculative engine's
    verify span (its step less the proposal) and elsewhere: a collection inside the span counts as
    verify time in the engine's figure."""

    def __init__(self, dec):
        self.where = "other"
        self.started = 0.0
        self.ms = defaultdict(float)
        self.count = defaultdict(int)
        if dec is not None:
            step, propose = dec.step, dec.proposer.propose

            def in_step(batch):
                self.where = "verify"
                try:
                    return step(batch)
                finally:
                    self.where = "other"

            def in_propose(*a, **k):
                self.where = "propose"
                try:
                    return propose(*a, **k)
                finally:
                    self.where = "verify"

            dec.step, dec.proposer.propose = in_step, in_propose
        gc.callbacks.append(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        key = f"{self.where}.gen{info['generation']}"
        self.ms[key] += 1000 * (time.perf_counter() - self.started)
        self.count[key] += 1

    def close(self) -> dict:
        gc.callbacks.remove(self.callback)
        return {k: [self.count[k], round(v, 3)] for k, v in sorted(self.ms.items())}


def replay_times(graphs, repeats: int = 100) -> dict:
    """Mean replay time (ms) of each captured size, CUDA events around ``repeats`` replays."""
    out = {}
    for size, graph in sorted(graphs.graphs.items()):
        graph.replay()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        sync()
        out[size] = round(start.elapsed_time(end) / repeats, 4)
    return out


def profile_tables(llm, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(PROMPT, params)
        sync()
    averages = prof.key_averages()
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    print(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


def method_spec(method: str, tmp: Path, shape: str, k: int, layers: int = 0) -> dict | None:
    cfg = qwen3_config(shape) | (dict(num_hidden_layers=layers) if layers else {})
    if method in ("plain", "mtp-plain"):
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if method == "draft":
        draft = write_shape(tmp / "first2", shape)
        (draft / "config.json").write_text(json.dumps(cfg | dict(num_hidden_layers=2)))
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    if method == "eagle3":
        return {
            "method": "eagle3",
            "model": str(write_eagle3_head(tmp / "eagle3", cfg)),
            "num_speculative_tokens": k,
        }
    if method == "dflash":  # its default geometry: a block of 16, 15 proposals
        return {"method": "dflash", "model": str(write_dflash_draft(tmp / "dflash", cfg))}
    if method == "mtp":  # its default depth (1)
        return {"method": "mtp"}
    raise ValueError(f"unknown method {method!r}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default="plain,ngram,eagle3")
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--mtp-layers", type=int, default=24)
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after each engine starts")
    parser.add_argument(
        "--profile-tokens", type=int, default=12, help="tokens of the profiled run; 0 skips it"
    )
    parser.add_argument(
        "--layers", type=int, default=0, help="override the target's layers (a CPU smoke run)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = write_shape(tmp / "target", args.shape)
        if args.layers:
            cfg = json.loads((target / "config.json").read_text()) | dict(num_hidden_layers=args.layers)
            (target / "config.json").write_text(json.dumps(cfg))
        qwen35 = None
        plain_ms = {}  # target -> a plain step (the plain row's 1 / tok/s)
        for method in args.methods.split(","):
            spec = method_spec(method, tmp, args.shape, args.k, args.layers)
            path = target
            if method in ("mtp", "mtp-plain"):
                qwen35 = qwen35 or write_config_shape(tmp / "qwen3.5", qwen3_5_config(args.mtp_layers))
                path = qwen35
            started = time.perf_counter()
            with LLM(
                str(path),
                load_format="dummy",
                dtype=args.dtype,
                max_kv_cache_capacity=2048,
                speculative_config=spec,
                engine_process=False,
            ) as llm:
                built = time.perf_counter() - started
                if args.gc_freeze:  # what the engine holds after its start leaves the collector's scans
                    gc.collect()
                    gc.freeze()
                clock = GcClock(llm.engine.speculative)
                row = run(llm, PROMPT, args.tokens, 1)  # the benchmark's figure, same formula
                gc_ms = clock.close()
                figure = dict(
                    figure="verify_profile",
                    method=method,
                    spec=spec and {k: v for k, v in spec.items() if k != "model"},
                    build_s=round(built, 1),
                    tok_s=round(row["tok_s"], 1),
                    step_ms=round(1000 / row["tok_s"], 4),
                    verify_ms=round(row["verify_ms"], 4),
                    propose_ms=round(row["propose_ms"], 4),
                    per_step=round(row["per_step"] or 0, 3),
                    gc_freeze=args.gc_freeze,
                    gc_count_ms_two_runs=gc_ms,  # where: [collections, ms] over the warm-up and timed run
                )
                if spec is None:
                    plain_ms[path] = figure["step_ms"]
                elif path in plain_ms:
                    figure["verify_over_plain"] = round(figure["verify_ms"] / plain_ms[path], 3)
                dec = llm.engine.speculative
                if dec is not None:
                    figure["verify_steps"], figure["graph_steps"] = dec.verify_steps, dec.graph_steps
                    spans, dec = instrument(llm)
                    spans.enabled = True
                    before = dec.stats.verification_time, dec.stats.steps
                    llm.generate(
                        PROMPT, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
                    )
                    steps = dec.stats.steps - before[1]
                    figure["instrumented_verify_ms"] = round(
                        1000 * (dec.stats.verification_time - before[0]) / max(steps, 1), 4
                    )
                    figure["instrumented_steps"] = steps
                    figure["instrumented_spans_ms_per_step"] = spans.report(steps)
                    figure["instrumented_calls"] = dict(spans.count)
                    spans.enabled = False
                graphs = llm.engine.runner.graphs
                if graphs is not None:
                    figure["graph_sizes"] = graphs.sizes
                    figure["aux_layers"] = list(graphs.aux_layers)
                print(json.dumps(figure), flush=True)
                if args.profile_tokens:
                    print(f"--- torch profiler, {method}, {args.profile_tokens} tokens ---", flush=True)
                    profile_tables(llm, args.profile_tokens)
                if graphs is not None:  # last: replays write the scratch inputs of the last step
                    print(
                        json.dumps(
                            dict(figure="graph_replay_ms", method=method, by_rows=replay_times(graphs))
                        ),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
