"""What the HTTP server costs: the same workload in-process (LLM.generate_stream) and over HTTP
streaming (`trtedge serve`, /v1/chat/completions with stream=true), in one run.

    python benchmarks/server_overhead.py [--requests 64] [--concurrency 16] [--max-tokens 64] [--rounds 1]

Both sides run the embedded SmolLM2-135M with in-flight batching (max_batch_size = --concurrency),
--requests chats of varied length, greedy, --max-tokens output tokens each (EOS ignored), at most
--concurrency in flight. Output tokens/s = generated tokens / wall time from the first request to
the last token. The two sides take turns (--rounds times each, in-process first), so one is idle
while the other runs; on a shared machine more rounds even out the noise. The ratio HTTP /
in-process of the summed figures is the server's efficiency (target >= 0.9). Wall-clock figures
move with whatever else runs on the machine, so each side's CPU time per output token (the
benchmark process for in-process, the server process for HTTP) is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtedge import LLM, SamplingParams  # noqa: E402

WORDS = (
    "the lighthouse keeper walked along the shore at dawn counting ships and gulls while the wind "
    "carried salt and stories from distant harbours where old sailors argued about maps tides and stars"
).split()


def workload(num: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(num):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))
        chats.append([{"role": "user", "content": f"Continue this story: {words}"}])
    return chats


def load_llm(args) -> LLM:
    llm = LLM(
        max_kv_cache_capacity=args.capacity,
        max_input_len=args.capacity // 2,
        enable_in_flight_batching=True,
        max_batch_size=args.concurrency,
    )
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))  # warm-up
    return llm


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of this process (all threads) or of process ``pid`` (Linux)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_in_process(args, llm: LLM, chats) -> tuple[float, int, list[float]]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ttfts: list[float] = []
    lock = threading.Lock()

    def one(chat) -> int:
        start = time.perf_counter()
        first = None
        tokens = 0
        for delta in llm.generate_stream(chat, params):
            if first is None:
                first = time.perf_counter() - start
            tokens += len(delta.token_ids)
        with lock:
            ttfts.append(first)
        return tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(one, chats))
    return time.perf_counter() - start, tokens, ttfts


async def run_over_http(args, chats, url: str) -> tuple[float, int, list[float]]:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(args.concurrency)
        ttfts: list[float] = []

        async def one(chat) -> int:
            body = {
                "messages": chat,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                start = time.perf_counter()
                first = None
                usage = None
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - start
                        usage = chunk.get("usage") or usage
                ttfts.append(first or 0.0)
                return usage["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(c) for c in chats)))
        return time.perf_counter() - start, tokens, ttfts


def start_server(args, port: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "trtedge.cli", "serve", "--port", str(port),
        "--max-kv-cache-capacity", str(args.capacity), "--max-input-len", str(args.capacity // 2),
        "--enable-in-flight-batching", "--max-batch-size", str(args.concurrency),
        "--max-queued-requests", str(args.requests), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"trtedge serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("trtedge serve did not start")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=1024, help="--max-kv-cache-capacity")
    parser.add_argument("--rounds", type=int, default=1, help="turns each side takes")
    args = parser.parse_args()
    chats = workload(args.requests)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "serve.log"
    proc = start_server(args, port, log)
    results = {"in-process": [], "HTTP (SSE)": []}
    try:
        httpx.post(f"{url}/v1/chat/completions", json={"messages": chats[0], "max_tokens": 4}, timeout=600)
        with load_llm(args) as llm:
            for _ in range(args.rounds):
                cpu = cpu_seconds()
                run = run_in_process(args, llm, chats)
                results["in-process"].append((*run, cpu_seconds() - cpu))
                cpu = cpu_seconds(proc.pid)
                run = asyncio.run(run_over_http(args, chats, url))
                results["HTTP (SSE)"].append((*run, cpu_seconds(proc.pid) - cpu))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    report(args, results)


def report(args, results: dict[str, list[tuple[float, int, list[float], float]]]) -> None:
    print(
        f"workload: {args.requests} chats, {args.max_tokens} output tokens each, concurrency {args.concurrency}"
    )
    columns = ("round", "tokens", "seconds", "output tok/s", "mean TTFT s", "CPU ms/token")
    print(f"{'':12}" + "".join(f"{c:>14}" for c in columns))
    tokens_per_s, cpu_per_token = {}, {}
    for name, runs in results.items():
        for i, (seconds, tokens, ttft, cpu) in enumerate(runs):
            row = (i + 1, tokens, f"{seconds:.2f}", f"{tokens / seconds:.1f}", f"{statistics.mean(ttft):.3f}")
            print(f"{name:12}" + "".join(f"{v:>14}" for v in row) + f"{1000 * cpu / tokens:>14.2f}")
        tokens_per_s[name] = sum(r[1] for r in runs) / sum(r[0] for r in runs)
        cpu_per_token[name] = sum(r[3] for r in runs) / sum(r[1] for r in runs)
        print(
            f"{name:12}{'all':>14}{'':>28}{tokens_per_s[name]:>14.1f}{'':>14}{1000 * cpu_per_token[name]:>14.2f}"
        )
    ratio = tokens_per_s["HTTP (SSE)"] / tokens_per_s["in-process"]
    cpu_ratio = cpu_per_token["in-process"] / cpu_per_token["HTTP (SSE)"]
    print(f"ratio HTTP / in-process, output tokens/s: {ratio:.3f} (target >= 0.9)")
    print(f"ratio HTTP / in-process, output tokens per CPU second: {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
