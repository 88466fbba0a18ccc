"""The nano-vllm workload over HTTP against the same engine offline, in one run.

    python benchmarks/http_throughput.py [--requests 256] [--concurrency 256]

Qwen3-0.6B shape, random bf16 weights (load_format="dummy"), the workload of gpu_throughput.py
(input and output lengths uniform in [100, 1024], temperature 0.6, EOS ignored). Offline: LLM in
this process. HTTP: `trtedge serve`'s app (build_app) on the same engine settings in a child
process, driven by streaming /v1/completions with token-id prompts, at most --concurrency in
flight, usage read from the final chunk. Prints one JSON line per side and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_throughput import run_trtedge, workload  # noqa: E402
from benchmarks.shapes import write_shape  # noqa: E402

SERVER = """
import sys, uvicorn
from trtedge import LLM
from trtedge.server.app import build_app
llm = LLM(sys.argv[1], load_format="dummy", dtype="bfloat16", device="cuda", enable_in_flight_batching=True,
          max_batch_size=int(sys.argv[3]), max_kv_cache_capacity=2048, max_input_len=1024,
          max_num_batched_tokens=8192)
uvicorn.run(build_app(llm), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
stats = llm.stats()  # after the drain: the steps of the warm-up and the run
print('{"figure": "http_server_engine", "steps": %d, "preemptions": %d, "engine_process": %s}'
      % (stats["steps"], stats["preemptions"], str(llm.engine_process).lower()), flush=True)
llm.close()
"""


async def drive(port: int, requests, concurrency: int) -> dict:
    """Send ``requests`` (index, prompt, max_tokens) at most ``concurrency`` at a time; the wall-clock
    span of the run and each request's time to its first token."""
    gate = asyncio.Semaphore(concurrency)
    produced = 0
    firsts: list[float] = []
    # httpx pools at most 100 connections by default: without these limits the 256 "in flight" of the
    # gate would be 100 on the wire, and the server would see a smaller batch than the offline run.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(i, prompt, n, record=True):
            nonlocal produced
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0.6,
                "seed": i,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                sent, first = time.time(), None
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if first is None:
                            first = time.time() - sent
                        if '"usage"' in line:
                            usage = json.loads(line[6:]).get("usage")
                            if usage and record:
                                produced += usage["completion_tokens"]
            if record and first is not None:
                firsts.append(first)

        await one(0, requests[0][1], 8, record=False)  # warm-up
        start = time.time()
        await asyncio.gather(*(one(i, p, n) for i, p, n in requests))
        end = time.time()
    return dict(output_tokens=produced, start=start, end=end, firsts=firsts)


def drive_slice(port: int, requests, concurrency: int) -> dict:
    return asyncio.run(drive(port, requests, concurrency))


def drive_all(port: int, requests, concurrency: int, processes: int) -> dict:
    """The workload from ``processes`` client processes (requests dealt round-robin, the concurrency
    split between them), so that one Python client's own work does not set the figure."""
    indexed = [(i, p, n) for i, (p, n) in enumerate(requests)]
    if processes <= 1:
        parts = [drive_slice(port, indexed, concurrency)]
    else:
        from concurrent.futures import ProcessPoolExecutor

        share = max(1, concurrency // processes)
        with ProcessPoolExecutor(processes) as pool:
            parts = list(
                pool.map(
                    drive_slice,
                    [port] * processes,
                    [indexed[k::processes] for k in range(processes)],
                    [share] * processes,
                )
            )
    produced = sum(part["output_tokens"] for part in parts)
    elapsed = max(part["end"] for part in parts) - min(part["start"] for part in parts)
    firsts = sorted(t for part in parts for t in part["firsts"])
    return dict(
        client_processes=processes,
        output_tokens=produced,
        seconds=round(elapsed, 2),
        output_tokens_per_s=round(produced / elapsed, 1),
        ttft_p50_ms=round(1000 * firsts[len(firsts) // 2], 1) if firsts else None,
        ttft_max_ms=round(1000 * firsts[-1], 1) if firsts else None,
    )


async def engine_counts(port: int) -> dict:
    """The server's engine steps and preemptions so far (its /metrics gauges)."""
    counts = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        text = (await client.get("/metrics")).text
    for line in text.splitlines():
        for key in ("steps", "preemptions"):
            if line.startswith(f"trtedge_engine_{key} "):
                counts[key] = int(float(line.split()[1]))
    return counts


def trtedge_bench(port: int, requests, concurrency: int) -> dict:
    """`trtedge bench --url` against the same server: its random dataset at the workload's mean
    lengths and spread (uniform in [100, 1024] is 562 +- 82%), streaming, the same concurrency."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        argv = ["bench", "run", "--url", f"http://127.0.0.1:{port}", "--num-prompts", str(len(requests))]
        argv += ["--concurrency", str(concurrency), "--input-len", "562", "--output-len", "562"]
        argv += ["--range-ratio", "0.82", "--temperature", "0.6", "--json", str(out)]
        subprocess.run([sys.executable, "-c", "from trtedge.cli import main; main()", *argv], check=True)
        metrics = json.loads(out.read_text())["metrics"]
    return dict(
        failed=metrics["failed"],
        output_tokens=metrics["total_output_tokens"],
        seconds=round(metrics["duration_s"], 2),
        output_tokens_per_s=round(metrics["output_throughput"], 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--skip-offline", action="store_true", help="the HTTP side alone (no ratio)")
    parser.add_argument(
        "--engine-process",
        choices=["auto", "on", "off"],
        default="auto",
        help="the server's engine core in its own process (on) or in the server's (off); offline: auto",
    )
    parser.add_argument(
        "--trtedge-bench",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run `trtedge bench --url` against the same server (its own random prompts)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="drive the HTTP side from this many client processes (the concurrency split between them)",
    )
    parser.add_argument(
        "--py-spy",
        metavar="FILE",
        help="sample the server and its engine core with py-spy for 8 s of the HTTP side (raw stacks)",
    )
    args = parser.parse_args()
    requests = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_shape(Path(tmp) / "qwen3-0.6b", "qwen3-0.6b")
        offline = None
        if not args.skip_offline:
            offline = run_trtedge(directory, requests, args.concurrency)
            print(json.dumps(dict(figure="offline_throughput", engine="trtedge", **offline)), flush=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "TRTEDGE_ENGINE_PROCESS": {"auto": "auto", "on": "1", "off": "0"}[args.engine_process],
        }
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(directory), str(port), str(args.concurrency)], env=env
        )
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            before = asyncio.run(engine_counts(port))
            spy = None
            if args.py_spy:  # the server and its engine core process, while the HTTP side runs
                cmd = ["py-spy", "record", "--pid", str(server.pid), "--subprocesses", "--rate", "200"]
                cmd += ["--format", "raw", "--duration", "8", "--output", args.py_spy]
                spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
                time.sleep(1)  # attached before the first request
            http = drive_all(port, requests, args.concurrency, args.client_processes)
            if spy is not None:
                spy.wait(timeout=60)
            after = asyncio.run(engine_counts(port))
            http.update({key: after[key] - before[key] for key in after})
            bench = trtedge_bench(port, requests, args.concurrency) if args.trtedge_bench else None
        finally:
            server.terminate()
            server.wait(timeout=60)
        print(
            json.dumps(
                dict(
                    figure="http_throughput",
                    engine="trtedge serve",
                    concurrency=args.concurrency,
                    engine_process=args.engine_process,
                    **http,
                )
            ),
            flush=True,
        )
        if bench is not None:
            print(
                json.dumps(dict(figure="trtedge_bench_url", concurrency=args.concurrency, **bench)),
                flush=True,
            )
        if offline is not None:
            ratio = http["output_tokens_per_s"] / offline["output_tokens_per_s"]
            print(json.dumps(dict(figure="http_vs_offline", ratio=round(ratio, 2))), flush=True)


if __name__ == "__main__":
    main()
