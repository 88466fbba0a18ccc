"""Launch time of the embedded SmolLM2 with the bundle cache: first launch (build) vs second (hit).

Each launch is a fresh process with an empty cache to start with; the time is LLM() alone (torch
import excluded). "direct" loads the GGUF checkpoint without any bundle, as launches did before
the cache. Run: python benchmarks/bundle_launch.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
import torch  # noqa: F401 - imported before the clock starts
mode, cache = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if mode == "direct":
    from trtedge.runtime.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    checkpoint = resolve_checkpoint(None)
    checkpoint.load_tokenizer()
    load_model(checkpoint, dtype="auto", device="auto", weights="auto", max_positions=8192)
    built = None
else:
    from trtedge import LLM
    llm = LLM(cache_dir=cache)
    built = llm.bundle.built
    llm.close()
print(json.dumps({"seconds": time.perf_counter() - start, "built": built}))
"""


def launch(mode: str, cache: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, cache], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="trtedge-bench-") as cache:
            direct = launch("direct", cache)
            first = launch("llm", cache)
            second = launch("llm", cache)
        assert first["built"] and not second["built"]
        print(
            f"SmolLM2 launch: direct (no bundle) {direct['seconds']:.2f} s, "
            f"first LLM() (build) {first['seconds']:.2f} s, second LLM() (cache hit) {second['seconds']:.2f} s "
            f"[load average {load:.1f}, {os.cpu_count()} CPUs]"
        )


if __name__ == "__main__":
    main()
