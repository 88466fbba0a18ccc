#!/usr/bin/env python3
"""Refresh scripts/http_response_examples.json from a running `trtedge serve URL` (the embedded model):
sends every example request of the HTTP reference with "stream": false, and GETs /health and
/v1/models. Then run scripts/generate_http_reference.py.

    trtedge serve --port 8000 &  python scripts/capture_http_examples.py http://127.0.0.1:8000
"""

from __future__ import annotations

import json
import sys

import httpx
from generate_http_reference import EXAMPLES, RESPONSES


def capture(url: str) -> dict:
    gets = ("/health", "/v1/models", "/tokenizer_info")
    found = {path: httpx.get(url + path, timeout=30).json() for path in gets}
    for path, body in EXAMPLES.items():
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        if path.startswith("/v1/") and not path.endswith("count_tokens"):
            body["stream"] = False
        response = httpx.post(url + path, json=body, timeout=300)
        response.raise_for_status()
        found[path] = response.json()
    return found


if __name__ == "__main__":
    RESPONSES.write_text(json.dumps(capture(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {RESPONSES}")
