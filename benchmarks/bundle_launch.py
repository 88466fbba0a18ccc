"""Launch time of the embedded SmolLM2 with the bundle cache: first launch (build) vs second (hit).

Each launch is a fresh process, the cache empty at the first; times exclude the torch import.
"bundle" is finding (hit) or building (miss) the bundle, the rest is model load and engine start.
"direct" loads the GGUF checkpoint without any bundle, as launches did before the cache. Run: python benchmarks/bundle_launch.py [--repeat N]
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
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    checkpoint = resolve_checkpoint(None)
    checkpoint.load_tokenizer()
    load_model(checkpoint, dtype="auto", device="auto", weights="auto", max_positions=8192)
    built = None
    prepare = None
else:
    from trtedge import LLM
    from trtedge.config import LaunchConfig
    from trtedge.runtime.artifacts.bundle import BuildProfile, prepare_bundle
    bundle = prepare_bundle(None, BuildProfile.from_launch(LaunchConfig()), cache_dir=cache)
    built, prepare = bundle.built, time.perf_counter() - start
    bundle.release()
    LLM(cache_dir=cache).close()  # finds what prepare_bundle just found or built
print(json.dumps({"seconds": time.perf_counter() - start, "built": built, "prepare": prepare}))
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
            f"first (build) {first['seconds']:.2f} s of which bundle {first['prepare']:.2f} s, "
            f"second (cache hit) {second['seconds']:.2f} s of which bundle {second['prepare']:.2f} s "
            f"[load average {load:.1f}, {os.cpu_count()} CPUs]"
        )


if __name__ == "__main__":
    main()
