"""Where a speculative verify step's time goes, per method, at batch 1: the figure
``benchmarks/speculative.py`` prints (verify ms over a plain step, its ``run`` with one warm-up and one
timed run), with the spread of the timed run's verify steps and the garbage collections inside and
outside the verify span; the verify span split into its parts, each closed by a device sync (host
staging and the target forward, the commit, the proposer's bookkeeping); the pure replay time of each
captured decode graph by rows (1 row: a plain step's forward; k + 1 rows: a chain verify step's); and
the torch profiler's kernel and host tables over a few steps. For the note when the verify target
(<= 1.3x a plain step) is missed.

    python benchmarks/gpu_verify_profile.py --methods plain,eagle3,dflash,draft,ngram --gc-methods plain,eagle3 \
        --profile-methods eagle3
    python benchmarks/gpu_verify_profile.py --methods mtp,mtp-plain   # a Qwen3.5-style target and its plain row

Every engine runs in this process (the wrappers reach its decoder), so a ratio's plain row must come
first among a target's engines. ``plain`` is the plain engine (asynchronous scheduling, as the
benchmark's plain row); ``draft`` drafts with the target's first 2 layers; eagle3 / dflash are the
random heads of ``benchmarks/speculative.py`` (dflash at its default geometry: a block of 16, 15
proposals); mtp at its default depth (1). ``--gc-methods`` measures those engines again with the heap frozen
(``gc.freeze()``) and then with the collector disabled.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import qwen3_5_config, qwen3_config, write_config_shape, write_shape  # noqa: E402
from benchmarks.speculative import run, write_dflash_draft, write_eagle3_head  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402

START = time.perf_counter()
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
            if not self.enabled:  # labelled for the profiler's tables
                with torch.profiler.record_function(name):
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
    graphs = llm.engine.runner.graphs
    if graphs is not None:  # inside the score span: the staging and the replay's launch, each synced
        graphs._stage = spans.wrap("graphs.stage (all graph steps)", graphs._stage)
        for graph in graphs.graphs.values():
            try:
                graph.replay = spans.wrap(
                    "graphs.replay (all graph steps)", graph.replay, "graphs.replay host launch"
                )
            except AttributeError:  # a graph object that takes no attributes: its launch goes unsplit
                break
    step = dec.step

    def counted(batch):
        before = dec.stats.steps
        out = step(batch)
        spans.count["steps"] += dec.stats.steps - before
        return out

    dec.step = counted
    return spans, dec


def device_timeline(llm, tokens: int) -> dict:
    """Per speculative step, on the device's clock (CUDA events, no sync added): the draft's span,
    from the step's start to the end of the proposer's queued work, and the verify's, from there to
    the end of the target's verify forward. A gap the device idles while the host stages the verify
    counts in the verify's span; host staging done while the draft still runs does not. The verify
    span is the cost a verify step adds to a step's device time, the figure to compare with a plain
    step's."""
    dec = llm.engine.speculative
    step, propose, score = dec.step, dec.proposer.propose, dec._score
    marks: list[list] = []

    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed_step(batch):
        marks.append([event()])
        return step(batch)

    def timed_propose(*a, **k):
        out = propose(*a, **k)
        marks[-1].append(event())
        return out

    def timed_score(*a, **k):
        out = score(*a, **k)
        marks[-1].append(event())
        return out

    dec.step, dec.proposer.propose, dec._score = timed_step, timed_propose, timed_score
    try:
        llm.generate(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    finally:
        dec.step, dec.proposer.propose, dec._score = step, propose, score
    sync()
    whole = [m for m in marks if len(m) == 3]
    draft = sorted(m[0].elapsed_time(m[1]) for m in whole)
    verify = sorted(m[1].elapsed_time(m[2]) for m in whole)
    if not whole:
        return {"steps": 0}
    return {
        "steps": len(whole),
        "draft_device_ms_median": round(draft[len(draft) // 2], 4),
        "verify_device_ms_median": round(verify[len(verify) // 2], 4),
        "verify_device_ms_p90": round(verify[int(0.9 * (len(verify) - 1))], 4),
    }


def sm_clock() -> int | None:
    """The device's SM clock (MHz) through NVML, None where it cannot be read."""
    try:
        return torch.cuda.clock_rate() if torch.cuda.is_available() else None
    except Exception:  # no NVML bindings
        return None


class StepClock:
    """Per verify step: the engine's verify span (its SpecStats), and the time the interpreter spends in
    garbage collection, by generation, inside a speculative step's verify span (the step less the
    proposal) and elsewhere: a collection inside the span counts as verify time in the engine's
    figure."""

    def __init__(self, dec):
        self.where = "other"
        self.started = 0.0
        self.ms = defaultdict(float)
        self.count = defaultdict(int)
        self.verify_ms: list[float] = []
        self.clocks: list[int | None] = []
        self.dec, self.saved = dec, None
        if dec is not None:
            step, propose = dec.step, dec.proposer.propose
            self.saved = step, propose

            def in_step(batch):
                self.where = "verify"
                before, steps = dec.stats.verification_time, dec.stats.steps
                try:
                    return step(batch)
                finally:
                    self.where = "other"
                    if dec.stats.steps > steps:
                        self.verify_ms.append(1000 * (dec.stats.verification_time - before))
                        if len(self.verify_ms) % 4 == 1:  # outside the span: the SM clock now
                            self.clocks.append(sm_clock())

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
        if self.saved is not None:
            self.dec.step, self.dec.proposer.propose = self.saved
        out = {"gc_collections_ms": {k: [self.count[k], round(v, 3)] for k, v in sorted(self.ms.items())}}
        if self.verify_ms:
            ms = sorted(self.verify_ms)
            median = ms[len(ms) // 2]
            out |= dict(
                verify_steps=len(ms),
                verify_median_ms=round(median, 4),
                verify_p90_ms=round(ms[int(0.9 * (len(ms) - 1))], 4),
                verify_max_ms=round(ms[-1], 4),
                verify_over_2x_median=[round(v, 3) for v in ms if v > 2 * median],
            )
        clocks = sorted(c for c in self.clocks if c is not None)
        if clocks:
            out["sm_clock_mhz_min_median_max"] = [clocks[0], clocks[len(clocks) // 2], clocks[-1]]
        return out


def measure(llm, tokens: int) -> dict:
    """The benchmark's figure (``benchmarks.speculative.run``: one warm-up run, one timed) with the
    step clock: collections over both runs, the verify steps' spread over the timed one."""
    clock = StepClock(llm.engine.speculative)
    generate = llm.generate

    def marked(*a, **k):  # the step figures are the last (timed) run's
        clock.verify_ms.clear()
        clock.clocks.clear()
        return generate(*a, **k)

    llm.generate = marked
    try:
        row = run(llm, PROMPT, tokens, 1)
    finally:
        del llm.generate
    out = dict(
        tok_s=round(row["tok_s"], 1),
        step_ms=round(1000 / row["tok_s"], 4),
        verify_ms=round(row["verify_ms"], 4),
        propose_ms=round(row["propose_ms"], 4),
        per_step=round(row["per_step"] or 0, 3),
    )
    return out | clock.close()


def replay_times(graphs, repeats: int = 100, launches: int = 20) -> dict:
    """Mean replay time (ms) of each captured size, CUDA events around ``repeats`` replays; and the
    host's time in one ``replay()`` call with the device idle (median of ``launches``, each after a
    sync): what a launch costs when nothing is queued before it. Each size replays a step of padding
    rows (context 1; the staged inputs of the last real step are another size's layout)."""
    out, launch = {}, {}
    for size, graph in sorted(graphs.graphs.items()):
        graphs.io.pad(size)
        graph.replay()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        sync()
        out[size] = round(start.elapsed_time(end) / repeats, 4)
        spans = []
        for _ in range(launches):
            sync()
            began = time.perf_counter()
            graph.replay()
            spans.append(1000 * (time.perf_counter() - began))
        sync()
        launch[size] = round(sorted(spans)[launches // 2], 4)
    out["host_launch_ms_device_idle"] = launch
    out["sm_clock_mhz"] = sm_clock()
    return out


def profile_steps(llm, steps: int, skip: int = 4) -> None:
    """The torch profiler's tables for speculative decoding: the kernels of a short run (its prefill
    and about ``skip + steps`` speculative steps; a profiler of the calling thread sees every kernel),
    then the host ops of ``steps`` speculative steps after the first ``skip`` of another run, that
    profiler started and stopped on the engine's thread (the steps run there: a profiler of the
    calling thread records none of their host ops)."""
    tokens = 4 * (skip + steps) + 8
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(PROMPT, SamplingParams(max_tokens=skip + steps, temperature=0, ignore_eos=True))
            sync()
        print(f"kernels of a {skip + steps}-token run (its prefill included):")
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70
        )
        print(table, flush=True)
    dec = llm.engine.speculative
    step, state = dec.step, {"seen": 0, "prof": None}

    def profiled(batch):  # a profiler failure must not fail the engine's step
        state["seen"] += 1
        if state["seen"] == skip + 1:
            try:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
                state["prof"] = prof
            except Exception as e:
                state["error"] = repr(e)
        try:
            return step(batch)
        finally:
            if state["seen"] == skip + steps and state["prof"] is not None:
                sync()
                try:
                    state["prof"].__exit__(None, None, None)
                except Exception as e:
                    state["error"], state["prof"] = repr(e), None

    dec.step = profiled
    try:
        llm.generate(PROMPT, params)
    finally:
        dec.step = step
    prof = state["prof"]
    if prof is None or state["seen"] < skip + steps:
        print(f"profiler: {state['seen']} speculative steps (wanted {skip + steps}); {state.get('error')}")
        return
    print(f"host ops of {steps} speculative steps (drafting and verification), the engine's thread:")
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    print(table, flush=True)


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
    if method == "mtp4":  # 4 tokens a chain
        return {"method": "mtp", "num_speculative_tokens": 4}
    raise ValueError(f"unknown method {method!r}")


def mtp_target_config(shape: str, layers: int) -> dict:
    """The hybrid target of the mtp rows, one MTP layer declared: the Qwen3.5-0.8B style for the 0.6B
    shape, transformers' default Qwen3.5 (~9B) for the 8B one."""
    if shape == "qwen3-8b":
        from benchmarks.gpu_hybrid_decode import QWEN3_5_9B

        return QWEN3_5_9B | dict(mtp_num_hidden_layers=1)
    return qwen3_5_config(layers)


def profile_method(method: str, args, tmp: Path, target: Path, plain_ms: dict) -> None:
    """One engine's figures, printed as they come."""
    qwen35 = tmp / "qwen3.5"
    spec = method_spec(method, tmp, args.shape, args.k, args.layers)
    path = target
    if method in ("mtp", "mtp4", "mtp-plain"):
        if not qwen35.exists():
            write_config_shape(qwen35, mtp_target_config(args.shape, args.mtp_layers))
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
        figure = dict(
            figure="verify_profile",
            method=method,
            spec=spec and {k: v for k, v in spec.items() if k != "model"},
            build_s=round(built, 1),
            process_s=round(time.perf_counter() - START, 1),
            as_is=measure(llm, args.tokens),  # the collector as the engine leaves it
        )
        dec = llm.engine.speculative
        if dec is not None and method in args.host_methods.split(","):
            # the same engine with the drafts read by the host before the verify forward, as before
            # device chains (eagle3: its tree path, which reads each step's tokens)
            proposer = dec.proposer
            chains = getattr(proposer, "device_chains", None)
            if chains is not None:
                proposer.device_chains = False
            dec.device_drafts = False
            figure["host_drafts"] = measure(llm, args.tokens)
            dec.device_drafts = True
            if chains is not None:
                proposer.device_chains = chains
        again = args.gc_methods == "all" or method in args.gc_methods.split(",")
        if again:  # then with the heap at this point frozen (left out of collections), then none
            gc.collect()
            gc.freeze()
            figure["gc_frozen"] = measure(llm, args.tokens)
            gc.disable()
            figure["gc_disabled"] = measure(llm, args.tokens)
            gc.enable()
            gc.unfreeze()
        for key in ("as_is", "host_drafts", "gc_frozen", "gc_disabled"):
            if key not in figure:
                continue
            if spec is None:
                plain_ms[path, key] = figure[key]["step_ms"]
            elif (path, key if key != "host_drafts" else "as_is") in plain_ms:
                ratio = figure[key]["verify_ms"] / plain_ms[path, key if key != "host_drafts" else "as_is"]
                figure[key]["verify_over_plain"] = round(ratio, 3)
        dec = llm.engine.speculative
        graphs = llm.engine.runner.graphs
        if graphs is not None:
            figure["graph_sizes"] = graphs.sizes
            figure["aux_layers"] = list(graphs.aux_layers)
        if dec is not None:
            figure["verify_steps"], figure["graph_steps"] = dec.verify_steps, dec.graph_steps
        print(json.dumps(figure), flush=True)
        if dec is not None and torch.cuda.is_available():
            timeline = device_timeline(llm, args.tokens)
            plain = plain_ms.get((path, "as_is"))
            if plain and timeline.get("steps"):
                timeline["verify_device_over_plain_step"] = round(
                    timeline["verify_device_ms_median"] / plain, 3
                )
            print(json.dumps(dict(figure="device_timeline", method=method) | timeline), flush=True)
        # each part of the span closed by a sync (the figure above has none)
        if dec is not None and not args.quick:
            figure = dict(figure="verify_spans", method=method)
            spans, dec = instrument(llm)
            spans.enabled = True
            before = dec.stats.verification_time, dec.stats.steps
            llm.generate(PROMPT, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
            steps = dec.stats.steps - before[1]
            figure["instrumented_verify_ms"] = round(
                1000 * (dec.stats.verification_time - before[0]) / max(steps, 1), 4
            )
            figure["instrumented_steps"] = steps
            figure["instrumented_spans_ms_per_step"] = spans.report(steps)
            figure["instrumented_calls"] = dict(spans.count)
            spans.enabled = False
            print(json.dumps(figure), flush=True)
        if (
            dec is not None
            and args.profile_steps
            and (args.profile_methods == "all" or method in args.profile_methods.split(","))
        ):
            print(f"--- torch profiler, {method}, {args.profile_steps} speculative steps ---", flush=True)
            profile_steps(llm, args.profile_steps)
        if graphs is not None and not args.quick:  # last: replays write the scratch inputs of the last step
            graphs.__dict__.pop("_stage", None)  # the instrumented run's wrappers off
            for graph in graphs.graphs.values():
                graph.__dict__.pop("replay", None)
            print(
                json.dumps(dict(figure="graph_replay_ms", method=method, by_rows=replay_times(graphs))),
                flush=True,
            )


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
    parser.add_argument(
        "--gc-methods",
        default="",
        help="comma-separated methods (all: every one) measured again after gc.collect(); gc.freeze(), "
        "then with the collector disabled",
    )
    parser.add_argument(
        "--profile-methods",
        default="",
        help="comma-separated methods to run the torch profiler on (all: every one)",
    )
    parser.add_argument("--profile-steps", type=int, default=4, help="speculative steps the profiler records")
    parser.add_argument(
        "--host-methods",
        default="",
        help="comma-separated methods measured again on the same engine with host drafts: the proposer's "
        "tokens read back before the verify forward (as before device chains)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the benchmark's figure and the device time line (no synced spans, no replay table)",
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
        plain_ms = {}  # target -> a plain step (the plain row's 1 / tok/s)
        for method in args.methods.split(","):
            try:
                profile_method(method, args, tmp, target, plain_ms)
            except Exception:  # the next engine still runs
                traceback.print_exc()
                print(json.dumps(dict(figure="failed", method=method)), flush=True)
                gc.enable()
                gc.unfreeze()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
