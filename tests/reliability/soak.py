"""A soak run against `trtedge serve`: many requests at a fixed concurrency over the generation
endpoints, streaming and not, with clients that hang up midway or before the first token; then the
server must hold nothing (KV blocks, admission seats) and its memory must stay flat."""

from __future__ import annotations

import asyncio
import collections
import json
import random
from dataclasses import dataclass, field

import httpx

from tests.reliability.common import CHAT, COMPLETIONS, MESSAGES, metrics, rss_bytes, sse_events

QUESTIONS = ["Say hello.", "What is 2+2?", "Name a color.", "Write a word.", "Count to five.", "Hi!"]


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    cancelled_before_first_token: int = 0
    retried_after_429: int = 0
    lost: list[str] = field(default_factory=list)  # requests that should have completed and did not
    by_endpoint: collections.Counter = field(default_factory=collections.Counter)
    rss_first_half: int = 0
    rss_second_half: int = 0
    seconds: float = 0.0

    @property
    def rss_growth(self) -> float:
        return (self.rss_second_half - self.rss_first_half) / self.rss_first_half

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "disconnected": self.disconnected,
            "cancelled_before_first_token": self.cancelled_before_first_token,
            "lost": len(self.lost),
            "retried_after_429": self.retried_after_429,
            "by_endpoint": dict(self.by_endpoint),
            "rss_first_half_mib": round(self.rss_first_half / 2**20, 1),
            "rss_second_half_mib": round(self.rss_second_half / 2**20, 1),
            "rss_growth_percent": round(100 * self.rss_growth, 2),
            "seconds": round(self.seconds, 1),
        }


def endpoints(model: str) -> dict[str, callable]:
    """Endpoint name -> (path, body builder). Extend here as new generation endpoints land."""

    def chat(rng: random.Random) -> dict:
        return {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}

    def completion(rng: random.Random) -> dict:
        if rng.random() < 0.5:
            return {"prompt": "The " + rng.choice(QUESTIONS)}
        return {"prompt": [rng.randrange(1, 40000) for _ in range(rng.randint(1, 40))]}

    def message(rng: random.Random) -> dict:
        return {"model": model, **chat(rng)}

    return {"chat": (CHAT, chat), "completions": (COMPLETIONS, completion), "messages": (MESSAGES, message)}


async def _one(
    client: httpx.AsyncClient, rng: random.Random, report: SoakReport, name: str, path: str, body: dict
):
    fate = rng.random()
    stream = rng.random() < 0.5
    body = {**body, "max_tokens": rng.randint(4, 24), "stream": stream, "seed": rng.randrange(2**32)}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    report.by_endpoint[f"{name}{' stream' if stream else ''}"] += 1
    if fate < 0.1:  # cancelled before the first token
        report.cancelled_before_first_token += 1
        if stream:
            async with client.stream("POST", path, json=body) as response:
                pass  # headers only: hang up before any token
        else:
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(rng.uniform(0, 0.02))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return
    if fate < 0.4:  # a random disconnect midway
        report.disconnected += 1
        if stream:
            async with client.stream("POST", path, json=body) as response:
                keep = rng.randint(1, 6)
                async for _ in response.aiter_lines():
                    keep -= 1
                    if keep == 0:
                        break
        else:
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(rng.uniform(0.01, 0.5))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return
    response = await client.post(path, json=body)
    while response.status_code in (429, 529):  # seats still held by clients that just hung up: retry
        report.retried_after_429 += 1
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
        response = await client.post(path, json=body)
    problem = _problem(response, stream, body["max_tokens"], anthropic=path == MESSAGES)
    if problem:
        report.lost.append(f"{name} stream={stream}: {problem}")
    else:
        report.completed += 1


def _problem(response: httpx.Response, stream: bool, max_tokens: int, anthropic: bool) -> str | None:
    """Why a response is not a full, well-formed answer (None when it is)."""
    if response.status_code != 200:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    if anthropic:
        return _anthropic_problem(response, stream, max_tokens)
    if stream:
        events = sse_events(response.text)
        if not events or events[-1][1] != "[DONE]":
            return "stream did not end with [DONE]"
        if any(name == "error" for name, _ in events):
            return f"stream error: {response.text[-300:]}"
        chunks = [json.loads(data) for _, data in events[:-1]]
        finishes = [
            c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")
        ]
        return None if finishes and finishes[-1] in ("stop", "length") else "stream without a finish_reason"
    body = response.json()
    choice = body["choices"][0]
    usage = body["usage"]
    if choice["finish_reason"] not in ("stop", "length") or not 1 <= usage["completion_tokens"] <= max_tokens:
        return f"malformed answer: {json.dumps(body)[:300]}"
    return None


def _anthropic_problem(response: httpx.Response, stream: bool, max_tokens: int) -> str | None:
    if stream:
        events = sse_events(response.text)
        names = [name for name, _ in events]
        if not names or names[0] != "message_start" or names[-1] != "message_stop" or "error" in names:
            return f"malformed message stream: {response.text[-300:]}"
        deltas = [json.loads(d) for n, d in events if n == "message_delta"]
        return None if deltas and deltas[-1]["delta"].get("stop_reason") else "stream without a stop_reason"
    body = response.json()
    tokens = body.get("usage", {}).get("output_tokens", 0)
    if body.get("type") != "message" or not body.get("stop_reason") or not 1 <= tokens <= max_tokens:
        return f"malformed message: {json.dumps(body)[:300]}"
    return None


async def _soak(url: str, num_requests: int, concurrency: int, seed: int, pid: int) -> SoakReport:
    report = SoakReport(requests=num_requests)
    rng = random.Random(seed)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    targets = endpoints(model)
    names = sorted(targets)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker(k: int):
            nonlocal done
            wrng = random.Random(seed * 1000 + k)
            while not queue.empty():
                queue.get_nowait()
                name = wrng.choice(names)
                path, build = targets[name]
                await _one(client, wrng, report, name, path, build(wrng))
                done += 1
                if done == num_requests // 2:
                    report.rss_first_half = rss_bytes(pid)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    report.seconds = loop.time() - start
    report.rss_second_half = rss_bytes(pid)
    del rng
    return report


def run(url: str, pid: int, num_requests: int, concurrency: int, seed: int = 0) -> SoakReport:
    return asyncio.run(_soak(url, num_requests, concurrency, seed, pid))


async def _settle(url: str, timeout: float) -> dict:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        gauges = metrics(url)
        busy = sum(
            gauges[k]
            for k in (
                "trtedge_admission_seats_in_use",
                "trtedge_kv_cache_blocks_in_use",
                "trtedge_requests_running",
                "trtedge_requests_waiting",
            )
        )
        if busy == 0 or loop.time() > end:
            return gauges
        await asyncio.sleep(0.2)


def settle(url: str, timeout: float = 60) -> dict:
    """The server's gauges once it holds nothing (or after ``timeout`` s: then the caller's asserts fail)."""
    return asyncio.run(_settle(url, timeout))
