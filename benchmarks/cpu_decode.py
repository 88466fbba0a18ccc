"""SmolLM2-135M on the CPU: trtedge (each weight mode) vs HF transformers vs llama.cpp, one run.

    python benchmarks/cpu_decode.py [--tokens 128] [--prompt-tokens 512] [--threads 2]
                                    [--llama-venv /work/bench-venv] [--skip-hf] [--skip-llama-cpp]

Every engine gets the same token ids: batch-1 greedy decode of --tokens new tokens (EOS ignored)
after a short chat prompt, and the prefill of a --prompt-tokens prompt (time to the first token).
trtedge runs the embedded GGUF as int4 (what `--weights auto` keeps for its Q4_1 tensors), int8 and
fp32 bundles; transformers runs the same GGUF dequantized to a float32 HF directory; llama.cpp runs
the GGUF file itself through llama-cpp-python, which lives in its own virtual environment (never a
trtedge dependency): --llama-venv is reused when it has llama_cpp, else created with
`pip install llama-cpp-python` (a source build with cmake: minutes); when that fails the row is
skipped with the reason. Ratios are against llama.cpp in this same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny import export_gguf_as_hf  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402
from trtedge.runtime.embedded import embedded_model_path  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
FILLER = (
    "The keeper climbed the spiral stairs each evening, trimmed the wick, wound the clockwork and "
    "watched the beam sweep across the grey water while gulls argued on the rocks below. "
)

LLAMA_CPP_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["model"], n_threads=args["threads"], n_threads_batch=args["threads"],
            n_ctx=2048, n_batch=1024, verbose=False)
def run(ids, n):
    llm.reset()
    start = time.perf_counter()
    first = None
    count = 0
    for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count >= n:
            break
    end = time.perf_counter()
    return first - start, (count - 1) / (end - first) if count > 1 else 0.0
run(args["chat"], 8)
_, decode = run(args["chat"], args["tokens"])
prefill, _ = run(args["long"], 1)
print(json.dumps({"decode": decode, "prefill_s": prefill, "version": __import__("llama_cpp").__version__}))
"""


def prompts(tokens: int, prompt_tokens: int) -> tuple[list[int], list[int]]:
    with LLM(weights="fp32", max_kv_cache_capacity=2048) as llm:
        chat = llm.encode_prompt(PROMPT)
        long = llm.encode_prompt(FILLER * (prompt_tokens // 20 + 2), apply_chat_template=False)
    return chat, long[:prompt_tokens]


def bench_trtedge(weights: str, chat: list[int], long: list[int], tokens: int) -> dict:
    with LLM(weights=weights, max_kv_cache_capacity=2048, max_input_len=len(long) + 8) as llm:
        metrics: list = []
        llm.generate(chat, SamplingParams(max_tokens=8, temperature=0))  # warm-up
        llm.generate(long[:64], SamplingParams(max_tokens=1, temperature=0))
        llm.generate(
            chat, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), on_metrics=metrics.append
        )
        llm.generate(long, SamplingParams(max_tokens=1, temperature=0), on_metrics=metrics.append)
        return {
            "decode": metrics[0].decode_tokens_per_second,
            "prefill_s": metrics[1].prefill_time,
            "bytes": llm.model.weight_bytes,
        }


def bench_transformers(hf_dir: Path, chat: list[int], long: list[int], tokens: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def run(ids: list[int], n: int) -> float:
        start = time.perf_counter()
        model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    with torch.no_grad():
        run(chat, 8)
        first = run(chat, 1)
        total = run(chat, tokens)
        prefill = run(long, 1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"decode": (tokens - 1) / (total - first), "prefill_s": prefill, "bytes": weight_bytes}


def llama_cpp_python(venv: Path) -> tuple[Path | None, str]:
    """The venv's python with llama_cpp importable (building it if needed), or None and why not."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        print(f"building llama-cpp-python from source into {venv} (minutes)...", file=sys.stderr)
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "llama-cpp-python"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"cannot create {venv} ({e})"
    if result.returncode != 0:
        return None, "pip install llama-cpp-python failed: " + result.stderr.strip()[-300:]
    return python, ""


def bench_llama_cpp(python: Path, chat: list[int], long: list[int], tokens: int, threads: int) -> dict:
    args = {
        "model": str(embedded_model_path()),
        "chat": chat,
        "long": long,
        "tokens": tokens,
        "threads": threads,
    }
    out = subprocess.run(
        [str(python), "-c", LLAMA_CPP_CHILD, json.dumps(args)], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    gguf_bytes = embedded_model_path().stat().st_size
    return {**result, "bytes": gguf_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--llama-venv", type=Path, default=Path(os.environ.get("LLAMA_CPP_VENV", "/work/bench-venv"))
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chat, long = prompts(args.tokens, args.prompt_tokens)
    rows: list[tuple[str, dict | None, str]] = []
    if not args.skip_llama_cpp:
        python, why = llama_cpp_python(args.llama_venv)
        if python is None:
            rows.append(("llama.cpp", None, why))
        else:
            result = bench_llama_cpp(python, chat, long, args.tokens, args.threads)
            rows.append((f"llama.cpp {result['version']} (GGUF Q4_1)", result, ""))
    for weights in ("int4", "int8", "fp32"):
        label = f"trtedge --weights {weights}" + (" (= auto)" if weights == "int4" else "")
        rows.append((label, bench_trtedge(weights, chat, long, args.tokens), ""))
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = export_gguf_as_hf(embedded_model_path(), Path(tmp) / "smollm2")
            rows.append(
                ("HF transformers (float32)", bench_transformers(hf_dir, chat, long, args.tokens), "")
            )
    peer = rows[0][1] if rows and rows[0][0].startswith("llama.cpp") and rows[0][1] else None
    load = os.getloadavg()
    print(
        f"SmolLM2-135M-Instruct, batch 1, {args.tokens} new tokens after a {len(chat)}-token prompt; "
        f"prefill of {len(long)} tokens; {args.threads} threads; load average {load[0]:.2f} {load[1]:.2f}"
    )
    print("| engine | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp | weights MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r, why in rows:
        if r is None:
            print(f"| {name} | skipped: {why} | | | | |")
            continue
        prefill = len(long) / r["prefill_s"]
        ratio = f"{r['decode'] / peer['decode']:.2f}x" if peer else "-"
        pratio = f"{prefill / (len(long) / peer['prefill_s']):.2f}x" if peer else "-"
        print(
            f"| {name} | {r['decode']:.1f} | {ratio} | {prefill:.0f} | {pratio} | {r['bytes'] / 2**20:.0f} |"
        )


if __name__ == "__main__":
    main()
