"""A logging proxy between a coding-agent CLI and `trtedge serve`: forwards every request and writes
it (method, path, the headers a server reads, JSON body) and the raw answer to a directory, one pair
of files per request. tests/e2e/test_agents.py reads the answers to check that the CLI printed what
the model wrote; the fixtures under tests/fixtures/agents/ were captured with it:

    python -m tests.e2e.agent_proxy --upstream http://127.0.0.1:8000 --port 8001 --out /tmp/capture \\
        --replace "$PWD=/home/user/project"

then point the CLI at port 8001 as docs/claude-code.md or docs/codex.md says. With --forward-anonymised
the server gets the request as the capture records it: the working directory, the OS version, today's
date and the session ids the CLI writes into its prompt are the same on every machine and every day, so
a greedy model's answer depends on the model alone (the tests run this way)."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

KEEP_HEADERS = ("content-type", "anthropic-version", "anthropic-beta", "accept")
_IDS = [  # what identifies a machine, a person or a session in the CLIs' requests
    (
        re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"),
        "00000000-0000-4000-8000-000000000000",
    ),
    (re.compile(r"\b[0-9a-f]{64}\b"), "0" * 64),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), "2026-01-01"),
    (re.compile(r"\b1\d{12}\b"), "1767225600000"),  # unix milliseconds
    (re.compile(r"(OS Version: )[^\\\"]*"), r"\g<1>Linux 6.0.0"),  # Claude Code's environment section
]


def anonymise(text: str, replace: list[tuple[str, str]]) -> str:
    for old, new in replace:  # the longest first: a home directory inside a project path
        text = text.replace(old, new)
    for pattern, new in _IDS:
        text = pattern.sub(new, text)
    return text


def build_app(
    upstream: str, out: Path, replace: list[tuple[str, str]], forward_anonymised: bool = False
) -> Starlette:
    out.mkdir(parents=True, exist_ok=True)
    replace = sorted(replace, key=lambda r: -len(r[0]))
    counter = itertools.count()
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def proxy(request: Request) -> Response:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        record: dict = {
            "method": request.method,
            "path": path,
            "headers": {k: v for k, v in request.headers.items() if k in KEEP_HEADERS},
        }
        try:
            record["body"] = json.loads(body) if body else None
        except ValueError:
            record["body_text"] = body.decode(errors="replace")
        stem = out / f"{next(counter):03d}-{request.method}{request.url.path.replace('/', '_')}"
        text = json.dumps(record, indent=1, ensure_ascii=False)
        stem.with_suffix(".json").write_text(anonymise(text, replace) + "\n")
        if forward_anonymised and "body" in record:
            body = anonymise(body.decode(), replace).encode()
        headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length")}
        reply = await client.send(
            client.build_request(request.method, path, headers=headers, content=body), stream=True
        )
        answer = stem.with_suffix(".answer")

        async def relay():
            with open(answer, "wb") as f:
                f.write(f"{reply.status_code}\n".encode())
                async for chunk in reply.aiter_raw():
                    f.write(chunk)
                    yield chunk

        skip = ("content-length", "transfer-encoding", "content-encoding")
        return StreamingResponse(
            relay(),
            status_code=reply.status_code,
            headers={k: v for k, v in reply.headers.items() if k not in skip},
            background=BackgroundTask(reply.aclose),
        )

    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", proxy, methods=methods)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--replace", action="append", default=[], metavar="OLD=NEW")
    ap.add_argument(
        "--forward-anonymised", action="store_true", help="send the server the anonymised request"
    )
    args = ap.parse_args()
    replace = [tuple(r.split("=", 1)) for r in args.replace]
    app = build_app(args.upstream, args.out, replace, args.forward_anonymised)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
