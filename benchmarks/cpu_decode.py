"""SmolLM2-135M on the CPU: trtedge (each weight mode) vs HF transformers vs llama.cpp, one run.

    python benchmarks/cpu_decode.py [--tokens 128] [--prompt-tokens 512] [--threads 2] [--rounds 3]
                                    [--llama-venv /work/bench-venv] [--skip-hf] [--skip-llama-cpp]

Every engine gets the same token ids: batch-1 greedy decode of --tokens new tokens (EOS ignored)
after a short chat prompt, and the prefill of a --prompt-tokens prompt (time to the first token).
trtedge runs the embedded GGUF as int4 (what `--weights auto` keeps for its Q4_1 tensors), int8 and
fp32 bundles; transformers runs the same GGUF dequantized to a float32 HF directory; llama.cpp runs
the GGUF file itself through llama-cpp-python in its own virtual environment (never a trtedge
dependency), as a child process: --llama-venv is reused when it has llama_cpp, else created with
`pip install llama-cpp-python` (a source build with cmake: minutes; AMX kernels off, see
`_cmake_args`); when that fails or the child dies, the row says why.

All engines stay loaded and are measured in turns, --rounds times (HF transformers once: it is
slow); each row shows its best round, so a burst of load from other processes on a shared machine
hits all engines alike. Ratios are against llama.cpp in this same run. "weights GB/s" is the
weight bytes a decode step reads (every linear layer and the lm_head) times decode tokens/s.
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
from trtedge.runtime.artifacts.embedded import embedded_model_path  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
FILLER = (
    "The keeper climbed the spiral stairs each evening, trimmed the wick, wound the clockwork and "
    "watched the beam sweep across the grey water while gulls argued on the rocks below. "
)

# The llama.cpp child: loads the model once, then answers one JSON request per stdin line.
LLAMA_CPP_CHILD = r"""
import faulthandler, json, sys, time
faulthandler.enable()
from llama_cpp import Llama
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["model"], n_threads=args["threads"], n_threads_batch=args["threads"],
            n_ctx=2048, n_batch=1024, verbose=False)
print(json.dumps({"version": __import__("llama_cpp").__version__}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    llm.reset()
    start = time.perf_counter()
    first, count = None, 0
    for _ in llm.generate(req["ids"], top_k=1, top_p=1.0, temp=0.0, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count >= req["n"]:
            break
    end = time.perf_counter()
    decode = (count - 1) / (end - first) if count > 1 else 0.0
    print(json.dumps({"prefill_s": first - start, "decode": decode}), flush=True)
"""


def prompts(prompt_tokens: int) -> tuple[list[int], list[int]]:
    with LLM(weights="fp32", max_kv_cache_capacity=2048) as llm:
        chat = llm.encode_prompt(PROMPT)
        long = llm.encode_prompt(FILLER * (prompt_tokens // 20 + 2), apply_chat_template=False)
    return chat, long[:prompt_tokens]


class Trtedge:
    def __init__(self, weights: str, max_input: int):
        self.llm = LLM(weights=weights, max_kv_cache_capacity=2048, max_input_len=max_input + 8)
        self.bytes = self.llm.describe()["weight_bytes"]

    def decode(self, ids: list[int], n: int) -> float:
        metrics: list = []
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        self.llm.generate(ids, params, on_metrics=metrics.append)
        return metrics[0].decode_tokens_per_second

    def prefill(self, ids: list[int]) -> float:
        metrics: list = []
        self.llm.generate(ids, SamplingParams(max_tokens=1, temperature=0), on_metrics=metrics.append)
        return metrics[0].prefill_time

    def close(self) -> None:
        self.llm.close()


class Transformers:
    def __init__(self, hf_dir: Path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _run(self, ids: list[int], n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def decode(self, ids: list[int], n: int) -> float:
        return (n - 1) / (self._run(ids, n) - self._run(ids, 1))

    def prefill(self, ids: list[int]) -> float:
        return self._run(ids, 1)

    def close(self) -> None:
        pass


class LlamaCpp:
    """llama-cpp-python in its own venv, as a child process that keeps the model loaded."""

    def __init__(self, python: Path, threads: int):
        args = {"model": str(embedded_model_path()), "threads": threads}
        self.proc = subprocess.Popen(
            [str(python), "-c", LLAMA_CPP_CHILD, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.version = self._read()["version"]
        self.bytes = embedded_model_path().stat().st_size

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            err = self.proc.stderr.read().strip()[-600:]
            signal = f" (signal {-code})" if code < 0 else ""
            raise RuntimeError(f"llama.cpp child exited with status {code}{signal}: {err or 'no output'}")
        return json.loads(line)

    def _ask(self, ids: list[int], n: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def decode(self, ids: list[int], n: int) -> float:
        return self._ask(ids, n)["decode"]

    def prefill(self, ids: list[int]) -> float:
        return self._ask(ids, 1)["prefill_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stderr.close()


def _cmake_args() -> str:
    """ggml built for this CPU's AVX-512 / VNNI / BF16, with its AMX kernels off: in some VMs
    (this development machine) they die with SIGILL on the first tile instruction."""
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        return ""
    if "avx512f" not in flags:
        return ""
    options = {
        "GGML_AVX512_VBMI": "avx512vbmi",
        "GGML_AVX512_VNNI": "avx512_vnni",
        "GGML_AVX512_BF16": "avx512_bf16",
        "GGML_AVX_VNNI": "avx_vnni",
    }
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    args += [f"-D{name}=ON" for name, flag in options.items() if flag in flags]
    return " ".join(args)


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
        env = {**os.environ, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS", _cmake_args())}
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "llama-cpp-python"], capture_output=True, text=True, env=env
        )
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"cannot create {venv} ({e})"
    if result.returncode != 0:
        return None, "pip install llama-cpp-python failed: " + result.stderr.strip()[-300:]
    return python, ""


def measure(engine, chat: list[int], long: list[int], tokens: int) -> dict:
    return {"decode": engine.decode(chat, tokens), "prefill_s": engine.prefill(long)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--llama-venv", type=Path, default=Path(os.environ.get("LLAMA_CPP_VENV", "/work/bench-venv"))
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started, load_start = time.time(), os.getloadavg()
    chat, long = prompts(args.prompt_tokens)
    engines: dict[str, object] = {}
    skipped: dict[str, str] = {}
    if not args.skip_llama_cpp:
        python, why = llama_cpp_python(args.llama_venv)
        try:
            if python is None:
                raise RuntimeError(why)
            child = LlamaCpp(python, args.threads)
            engines[f"llama.cpp (llama-cpp-python {child.version}, GGUF Q4_1)"] = child
        except RuntimeError as e:
            skipped["llama.cpp"] = str(e)
    for weights in ("int4", "int8", "fp32"):
        label = f"trtedge --weights {weights}" + (" (= auto)" if weights == "int4" else "")
        engines[label] = Trtedge(weights, len(long))
    results: dict[str, list[dict]] = {name: [] for name in engines}
    sizes = {name: engine.bytes for name, engine in engines.items()}

    def attempt(name: str, run) -> None:
        try:
            run()
        except RuntimeError as e:  # the llama.cpp child died: its row says why
            skipped[name] = str(e)
            engines.pop(name).close()
            results.pop(name)

    for name, engine in list(engines.items()):  # warm-up: first calls page in and size buffers
        attempt(name, lambda e=engine: (e.decode(chat, 8), e.prefill(long[:64])))
    for _ in range(args.rounds):
        for name, engine in list(engines.items()):
            attempt(name, lambda n=name, e=engine: results[n].append(measure(e, chat, long, args.tokens)))
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as tmp:
            hf = Transformers(export_gguf_as_hf(embedded_model_path(), Path(tmp) / "smollm2"))
            hf.decode(chat, 8)
            engines["HF transformers (float32)"] = hf
            sizes["HF transformers (float32)"] = hf.bytes
            results["HF transformers (float32)"] = [measure(hf, chat, long, args.tokens)]
    for engine in engines.values():
        engine.close()
    print_table(args, chat, long, sizes, results, skipped, load_start, time.time() - started)


def print_table(args, chat, long, sizes, results, skipped, load_start, seconds: float) -> None:
    best = {
        name: {"decode": max(r["decode"] for r in rs), "prefill_s": min(r["prefill_s"] for r in rs)}
        for name, rs in results.items()
        if rs
    }
    peer = next((best[n] for n in best if n.startswith("llama.cpp")), None)
    load = os.getloadavg()
    print(
        f"SmolLM2-135M-Instruct, batch 1, {args.tokens} new tokens after a {len(chat)}-token prompt; "
        f"prefill of {len(long)} tokens; {args.threads} threads; best of {args.rounds} rounds; "
        f"load average {load_start[0]:.2f} at start, {load[0]:.2f} {load[1]:.2f} at end; {seconds:.0f} s"
    )
    print(
        "| engine | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp | weights MiB | weights GB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} | | | | | |")
    for name, r in best.items():
        prefill = len(long) / r["prefill_s"]
        ratio = f"{r['decode'] / peer['decode']:.2f}x" if peer else "-"
        pratio = f"{prefill / (len(long) / peer['prefill_s']):.2f}x" if peer else "-"
        size = sizes[name]
        print(
            f"| {name} | {r['decode']:.1f} | {ratio} | {prefill:.0f} | {pratio} | {size / 2**20:.0f} "
            f"| {size * r['decode'] / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
