"""Memory of a per-layer embedding (PLE) table of 262,144 rows, resident vs cached.

Writes a random table (bfloat16, ``--width`` values a row; Gemma 3n E2B / Gemma 4 E2B have
35 layers x 256 = 8960) to a safetensors file, then in a fresh process each: loads it resident, or
cached with ``--slots`` device rows (the file memory-mapped), gathers ``--steps`` steps of
``--tokens`` random token ids, and reports the bytes held on the device (the table or the pool),
the process's memory growth (anonymous, and the file pages mapped in, which are reclaimable page
cache; on the CPU the "device" is host memory) and the pool counters.

Run: python benchmarks/ple_memory.py [--width 8960] [--slots 4097] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import json, sys, torch
from trtedge.runtime.models.ple import PerLayerEmbeddings, PleRuntimeConfig, map_ple_file

def rss():  # (anonymous, file-backed) resident bytes: the mapping's pages are page cache, reclaimable
    fields = dict(line.split(":") for line in open("/proc/self/status"))
    return [int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")]

path, residency, slots, device, steps, tokens = sys.argv[1:7]
device = torch.device(device)
before = rss()
cuda_before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
config = PleRuntimeConfig(residency, int(slots) if residency == "cached" else None, path)
table = map_ple_file(path)
ple = PerLayerEmbeddings(table, config, device, torch.bfloat16, 16.0, path, mapped=True)
gen = torch.Generator().manual_seed(0)
for _ in range(int(steps)):
    ids = torch.randint(0, table.shape[0], (int(tokens),), generator=gen)
    ple.rows(ids.to(device), ids.tolist())
if device.type == "cuda":
    torch.cuda.synchronize()
stats = ple.stats()
stats["rss_anon_bytes"], stats["rss_file_bytes"] = (a - b for a, b in zip(rss(), before))
stats["cuda_allocated_bytes"] = (torch.cuda.memory_allocated() - cuda_before) if device.type == "cuda" else None
print(json.dumps(stats))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=262_144)
    parser.add_argument("--width", type=int, default=35 * 256)
    parser.add_argument("--slots", type=int, default=4097)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--tokens", type=int, default=256, help="token ids per step (distinct rows <= slots - 1)"
    )
    args = parser.parse_args()
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ple.safetensors"
        table = torch.empty(args.rows, args.width, dtype=torch.bfloat16)
        for start in range(0, args.rows, 8192):  # random rows without a float32 copy of the whole table
            table[start : start + 8192].normal_()
        save_file({"model.embed_tokens_per_layer.weight": table}, str(path))
        del table
        table_bytes = args.rows * args.width * 2
        print(
            f"table: {args.rows} rows x {args.width} bf16 = {table_bytes / 2**20:.1f} MiB, device {args.device}"
        )
        for residency in ("resident", "cached"):
            argv = [sys.executable, "-c", _CHILD, str(path), residency, str(args.slots), args.device]
            out = subprocess.run(argv + [str(args.steps), str(args.tokens)], capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr)
            s = json.loads(out.stdout.strip().splitlines()[-1])
            line = (
                f"{residency:9s} device bytes {s['device_bytes'] / 2**20:9.1f} MiB"
                f"  staging {s['staging_bytes'] / 2**20:5.1f} MiB"
                f"  process memory +{s['rss_anon_bytes'] / 2**20:.1f} MiB anonymous"
                f" +{s['rss_file_bytes'] / 2**20:.1f} MiB mapped file pages"
            )
            if s["cuda_allocated_bytes"] is not None:
                line += f"  CUDA allocated {s['cuda_allocated_bytes'] / 2**20:9.1f} MiB"
            if residency == "cached":
                line += f"  hits {s['hits']} misses {s['misses']} evictions {s['evictions']}"
            print(line)


if __name__ == "__main__":
    main()
