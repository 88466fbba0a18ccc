"""Static look at the batch-1 quantized products without a GPU: compile ``triton_quant_gemv``'s
kernels for sm_90 (H100 / H200) on this machine and print, per tiling, the registers a thread
holds (occupancy), spills, and the instructions of the K loop: how many per weight byte and which.
A kernel bound by its instructions (int4) shows it here before any lease; the GPU figures come
from ``benchmarks/gpu_quant_gemv.py``.

Needs Triton (its wheel brings ptxas, nvdisasm and cuobjdump; no CUDA device, no driver):
``pip install triton==3.6.0`` into the venv. The launcher's specialization is assumed: every pointer
and integer argument divisible by 16 (the Qwen3-8B shapes), whole tiles.

    python scripts/quant_kernel_sass.py [--kernel fp8 int8 int4] [--tiles 64x256x4 64x128x4]
                                         [--mode 0 1] [--split 1] [--sass]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from trtedge.runtime.ops import triton_quant_gemv as tg  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
W8_ARGS = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16",
    "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32", "K": "i32", "stride_w": "i32",
}  # fmt: skip
INT4_ARGS = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16", "b_ptr": "*fp16",
    "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "N": "i32", "K": "i32",
}  # fmt: skip


def compile_sm90(fn, args: dict, constexprs: dict, warps: int, stages: int = 3):
    signature = {**args, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(args))}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(TOOLS / name), *flags, f.name], capture_output=True, text=True).stdout


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch to a label) in ``sass``."""
    instructions, labels, pending, loops = [], {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            labels.update({name: len(instructions) for name in pending})
            pending = []
            instructions.append(ins.group(1))
    for i, text in enumerate(instructions):
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            loops.append(instructions[labels[branch.group(1)] : i + 1])
    return max(loops, key=len, default=[])


def report(name: str, kernel, tile_bytes: int, show_sass: bool) -> None:
    cubin = kernel.asm["cubin"]
    usage = _tool("cuobjdump", cubin, "-res-usage")
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    sass = _tool("nvdisasm", cubin, "-c")
    body = loop_body(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
    threads = 32 * kernel.metadata.num_warps
    print(
        f"{name}: {regs.group(1) if regs else '?'} registers, {local.group(1) if local else '?'} B local, "
        f"{kernel.metadata.shared} B shared; K loop {len(body)} instructions a warp = "
        f"{len(body) * threads / 32 / (tile_bytes / 32):.2f} per weight byte a thread"
    )
    print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))
    if show_sass:
        print("\n".join("      " + t for t in body))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernel", nargs="+", default=["fp8", "int4"], choices=["fp8", "int8", "int4"])
    parser.add_argument("--tiles", nargs="+", default=["64x256x4", "32x256x4", "64x128x4"],
                        help="BLOCK_N x BLOCK_K x num_warps")  # fmt: skip
    parser.add_argument(
        "--mode", nargs="+", type=int, default=[0], help="8-bit: 0 tensor cores, 1 float32 tiles"
    )
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--sass", action="store_true", help="also print the loop's instructions")
    args = parser.parse_args()
    for kind in args.kernel:
        for tile in args.tiles:
            block_n, block_k, warps = (int(v) for v in tile.split("x"))
            common = dict(HAS_BIAS=False, EVEN=True, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=args.split)
            if kind == "int4":
                kernel = compile_sm90(tg._int4_gemv_kernel, INT4_ARGS, dict(CONVERT=True, **common), warps)
                report(f"int4 {tile}", kernel, block_n * block_k // 2, args.sass)
                continue
            for mode in args.mode:
                constexprs = dict(FP8=kind == "fp8", MODE=mode, **common)
                args8 = dict(W8_ARGS, w_ptr="*u8" if kind == "fp8" else "*i8")
                kernel = compile_sm90(tg._w8_gemv_kernel, args8, constexprs, warps)
                report(f"{kind} mode {mode} {tile}", kernel, block_n * block_k, args.sass)


if __name__ == "__main__":
    main()
