"""Paged decode attention at serving batch sizes: the Triton kernel's tilings against a plain copy
of the same bytes (the bandwidth roof), on the KV lengths of nano-vllm's workload.

    python benchmarks/gpu_decode_attention.py [--batch 256] [--sweep] [--kv-cache-dtype bf16,fp8]

One layer of the Qwen3-0.6B shape (16 query heads, 8 KV heads, head_dim 128, 16-token blocks). Each
sequence's context is its prompt (uniform in [100, 1024]) plus a uniform share of its output (uniform
in [100, 1024]): the lengths a step of the workload's steady state sees. The block tables are a
random permutation of the pool, as after a while of serving. Each figure times 100 calls captured in
one CUDA graph and prints a JSON line: microseconds a call, the KV bytes it reads and the achieved
GB/s, next to the copy of as many bytes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_quant_gemv import time_graph  # noqa: E402
from trtedge.runtime.ops import kv_fp8  # noqa: E402
from trtedge.runtime.ops.triton_attention import num_splits, paged_decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def copy_time(nbytes: int) -> float:
    """Microseconds to copy ``nbytes`` (half read, half written: as many bytes moved as read)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_graph(functools.partial(dst.copy_, src))


def split_layout(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache [blocks, block_size, heads, D + 4] with each block's values first, then its scales."""
    nb, bs, h, w = cache.shape
    out = torch.empty_like(cache).view(nb, -1)
    out[:, : bs * h * (w - 4)] = cache[..., : w - 4].reshape(nb, -1)
    out[:, bs * h * (w - 4) :] = cache[..., w - 4 :].reshape(nb, -1)
    return out.view(nb, bs, h, w)


def lengths(batch: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(100, 1024) + int(rng.random() * rng.randint(100, 1024)) for _ in range(batch)]


def build(batch: int, kv_dtype: str):
    ctx = lengths(batch)
    per_seq = [(n + BLOCK - 1) // BLOCK for n in ctx]
    width = max(per_seq)
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[at : at + n]
        at += n
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    if kv_dtype == "fp8":
        k, v = kv_fp8.quantize(k), kv_fp8.quantize(v)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    return q, k, v, tables.cuda(), lens, ctx


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--kv-cache-dtype", default="bf16")
    parser.add_argument(
        "--fp8-variants",
        type=int,
        nargs="+",
        default=[0],
        help="fp8 cache reads: 0 as served; 1 + layout (0 interleaved, 1 split per block)",
    )
    parser.add_argument("--sweep", action="store_true", help="every tiling below, not only the default")
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--splits", type=int, nargs="+", default=[1, 2, 4, -256, -512], help="-N: fixed splits of N tokens"
    )
    args = parser.parse_args()
    scale = HEAD_DIM**-0.5
    for batch, kv_dtype in itertools.product(args.batch, args.kv_cache_dtype.split(",")):
        q, k, v, tables, lens, ctx = build(batch, kv_dtype)
        row_bytes = k.shape[-1] * k.element_size()
        read = sum(ctx) * KV_HEADS * row_bytes * 2
        copy_us = copy_time(read)
        base = dict(
            batch=batch, kv_cache_dtype=kv_dtype, mean_ctx=round(sum(ctx) / batch), kv_mb=round(read / 1e6, 1)
        )
        print(json.dumps(dict(base, kernel="copy of the same bytes", us=round(copy_us, 1),
                              gb_s=round(read / copy_us / 1e3, 1))), flush=True)  # fmt: skip
        ref = None  # the default tiling's output (tests/gpu/test_cuda.py holds it to the torch reference)
        configs = [dict()]
        if args.sweep:
            configs += [
                dict(block_n=n, num_warps=w, num_stages=s, splits=p)
                for n, w, s, p in itertools.product(args.block_n, args.warps, args.stages, args.splits)
            ]
        if kv_dtype == "fp8":
            configs = [dict(c, fp8_variant=f) if f else c for f in args.fp8_variants for c in configs]
            split = (split_layout(k), split_layout(v))
        for cfg in configs:
            out = torch.empty_like(q)
            kc, vc = split if cfg.get("fp8_variant", 0) == 2 else (k, v)
            try:
                us = time_graph(
                    functools.partial(paged_decode_attention, q, kc, vc, tables, lens, scale, out, **cfg)
                )
            except Exception as exc:  # an over-large tiling: out of shared memory or registers
                print(json.dumps(dict(base, **cfg, error=str(exc).splitlines()[0][:120])), flush=True)
                continue
            row = dict(
                base, kernel="triton paged decode", **(cfg or {"default": num_splits(batch, KV_HEADS)})
            )
            row.update(us=round(us, 1), gb_s=round(read / us / 1e3, 1), of_copy=round(copy_us / us, 3))
            if ref is None:
                ref = out.clone()
            row["max_diff_vs_default"] = round((out.float() - ref.float()).abs().max().item(), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
