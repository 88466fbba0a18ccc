"""Reports: the rich tables, the JSON file, the plots and ``compare``."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from trtedge.bench.metrics import LATENCIES

LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}
STATS = ("mean", "median", "p90", "p99")


def run_tables(metrics: dict, title: str = "trtedge bench") -> list[Table]:
    """The figures of one run: a summary table and a latency table (ms). Figures come only from the
    requests that completed: with none, the tables show the counts and the errors, no zeros."""
    table = Table(title=escape(title), show_header=True, header_style="bold", min_width=len(title) + 4)
    table.add_column("metric")
    table.add_column("value", justify="right")
    failed = metrics["failed"]
    table.add_row(
        "requests ok / failed", f"{metrics['completed']} / " + (f"[red]{failed}[/]" if failed else "0")
    )
    table.add_row("duration (s)", f"{metrics['duration_s']:.2f}")
    if metrics["completed"]:
        table.add_row(
            "input / output tokens", f"{metrics['total_input_tokens']} / {metrics['total_output_tokens']}"
        )
        table.add_row("request throughput (req/s)", f"{metrics['request_throughput']:.2f}")
        table.add_row("input throughput (tok/s)", f"{metrics['input_throughput']:.1f}")
        table.add_row("output throughput (tok/s)", f"{metrics['output_throughput']:.1f}")
        if "goodput" in metrics:
            slo = ", ".join(f"{k}<={v:g}ms" for k, v in metrics["goodput_slo_ms"].items())
            table.add_row(f"goodput (req/s, {slo})", f"{metrics['goodput']:.2f}")
    if "decode_tokens_per_s" in metrics:
        table.add_row("decode (tok/s, batch 1)", f"{metrics['decode_tokens_per_s']:.1f}")
        bw = metrics["achieved_bandwidth_gbs"]
        peak = metrics.get("peak_bandwidth_gbs")
        share = f" ({100 * bw / peak:.1f}% of {peak:g})" if peak else " (peak unknown: --peak-bandwidth-gbs)"
        table.add_row("achieved bandwidth (GB/s)", f"{bw:.2f}{share}")
    for error, count in metrics.get("errors", {}).items():
        table.add_row(Text(f"failed x{count}", style="red"), Text(error))  # the server's words, not markup
    if not metrics["completed"]:
        return [table]
    latency = Table(show_header=True, header_style="bold", caption="latencies in ms")
    latency.add_column("latency")
    for stat in STATS:
        latency.add_column(stat, justify="right")
    for name in LATENCIES:
        d = metrics[f"{name}_ms"]
        latency.add_row(LATENCY_NAMES[name], *(_ms(d, s) for s in STATS))
    return [table, latency]


def _ms(described: dict, stat: str) -> str:
    """A latency figure, or "-" where no completed request gave one (TPOT of one-token answers)."""
    return f"{described[stat]:.1f}" if described.get("count", 1) else "-"


def sweep_table(points: list[dict], knob: str) -> Table:
    table = Table(title=f"trtedge bench sweep over {knob}", header_style="bold", caption="latencies in ms")
    short = {"concurrency": "conc", "request_rate": "rate/s"}[knob]
    headers = (short, "ok/fail", "req/s", "out\ntok/s", "TTFT\nmean", "TTFT\np99", "TPOT\nmean", "ITL\np99")
    for col in (*headers, "E2E\np99"):
        table.add_column(col, justify="right")
    for p in points:
        m = p["metrics"]
        figures = [
            f"{m['request_throughput']:.2f}",
            f"{m['output_throughput']:.1f}",
            _ms(m["ttft_ms"], "mean"),
            _ms(m["ttft_ms"], "p99"),
            _ms(m["tpot_ms"], "mean"),
            _ms(m["itl_ms"], "p99"),
            _ms(m["e2e_ms"], "p99"),
        ]
        if not m["completed"]:
            figures = ["-"] * len(figures)
        table.add_row(f"{p['value']:g}", f"{m['completed']}/{m['failed']}", *figures)
    return table


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot(path: str | Path, payload: dict) -> str | None:
    """Draw latency CDFs (one run) or throughput vs latency (a sweep). Returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install 'trtedge[bench]' to draw --plot"
    if payload.get("sweep"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        points = payload["sweep"]["points"]
        knob = payload["sweep"]["knob"]
        tput = [p["metrics"]["output_throughput"] for p in points]
        for ax, name in zip(axes, ("ttft", "tpot")):
            for stat, style in (("mean", "o-"), ("p99", "s--")):
                ax.plot(tput, [p["metrics"][f"{name}_ms"][stat] for p in points], style, label=stat)
            for p, x in zip(points, tput):
                ax.annotate(f"{knob}={p['value']:g}", (x, p["metrics"][f"{name}_ms"]["mean"]), fontsize=7)
            ax.set_xlabel("output throughput (tok/s)")
            ax.set_ylabel(f"{LATENCY_NAMES[name]} (ms)")
            ax.grid(alpha=0.3)
            ax.legend()
    else:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
        requests = [r for r in payload["requests"] if r["ok"]]
        samples = {
            "ttft": [r["ttft"] for r in requests if r["ttft"] is not None],
            "itl": [g for r in requests for g in r["itls"]],
            "e2e": [r["e2e"] for r in requests],
        }
        for ax, (name, values) in zip(axes, samples.items()):
            values = sorted(v * 1000 for v in values)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
            ax.set_xlabel(f"{LATENCY_NAMES[name]} (ms)")
            ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
            ax.grid(alpha=0.3)
    fig.suptitle(payload["config"].get("title", "trtedge bench"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


# ---- compare --------------------------------------------------------------------------------------


def flatten(metrics: dict, prefix: str = "") -> dict[str, float]:
    """Numeric figures as dotted names: {"ttft_ms.p99": 12.5, "output_throughput": 300.0, ...}."""
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("errors", "goodput_slo_ms"):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith(".count"):
            flat[name] = float(value)
    return flat


def runs_of(payload: dict) -> dict[str, dict]:
    """The runs of a result file by label: one ("run") or one per sweep point ("concurrency=4")."""
    if payload.get("sweep"):
        knob = payload["sweep"]["knob"]
        return {f"{knob}={p['value']:g}": p["metrics"] for p in payload["sweep"]["points"]}
    return {"run": payload["metrics"]}


def compare_tables(a: dict, b: dict, name_a: str, name_b: str) -> list[Table]:
    runs_a, runs_b = runs_of(a), runs_of(b)
    tables = []
    for label in [k for k in runs_a if k in runs_b]:
        fa, fb = flatten(runs_a[label]), flatten(runs_b[label])
        table = Table(title=escape(f"{label}: {name_b} / {name_a}"), header_style="bold")
        table.add_column("figure")
        table.add_column(name_a, justify="right")
        table.add_column(name_b, justify="right")
        table.add_column("B / A", justify="right")
        for key in [k for k in fa if k in fb]:
            ratio = f"{fb[key] / fa[key]:.2f}x" if fa[key] else "-"
            table.add_row(key, f"{fa[key]:.4g}", f"{fb[key]:.4g}", ratio)
        tables.append(table)
    return tables


def print_tables(tables: list[Table], console: Console | None = None) -> None:
    console = console or Console()
    for table in tables:
        console.print(table)


def speculative_line(spec: dict) -> str:
    """One line of speculative decoding figures (``LLM.speculative_metrics()``)."""
    return (
        f"speculative {spec['method']}: {spec['steps']} verification steps, acceptance rate "
        f"{spec['acceptance_rate']:.1%} ({spec['accepted_tokens']}/{spec['draft_tokens']} draft tokens), "
        f"{spec['mean_accepted_length']:.2f} tokens per step, proposal {spec['proposal_time']:.2f} s, "
        f"verification {spec['verification_time']:.2f} s"
    )
