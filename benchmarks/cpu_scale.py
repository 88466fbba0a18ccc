"""1B-8B models on the CPU: trtedge vs llama.cpp on random-weight GGUF files of real geometries.

    python benchmarks/cpu_scale.py [--geometry 1b,3b,8b] [--format q4_0,q4_k_m,q8_0,q5_k,q6_k] [--threads 1,2]
                                   [--prefill 128,1024] [--tokens 32] [--context 16] [--rounds 2] [--work-dir DIR]
                                   [--kv-cache-dtype auto|fp16|int8] [--llama-venv /work/bench-venv]
                                   [--skip-llama-cpp] [--baseline OTHER_CHECKOUT]

Each (geometry, format) GGUF file is written with the ``gguf`` package under --work-dir (a temporary
directory unless given; trtedge's bundles go to its ``cache`` folder there, never the user's cache):
random block bytes with scales of the size real checkpoints have, so no float weights are ever held
(an 8B file is written in seconds). The geometries are Llama-3.2-1B (tied embeddings), Qwen2.5-3B
(q/k/v biases, tied) and Llama-3-8B; the formats are Q4_0 (token embedding / output Q8_0), a
Q4_K_M-style mix (Q4_K, with attn_v, ffn_down and the embedding / output in Q6_K), Q8_0, Q5_K
(embedding Q8_0) and Q6_K.

Both engines run as child processes that answer one JSON request per stdin line (llama.cpp through
llama-cpp-python in its own venv, as ``cpu_decode.py`` builds it), one engine alive at a time so
that the peak RSS of each (VmHWM, read before it exits) is its own and two 8B models never share the
machine. In each round, for each thread count, each engine is started, warmed up, measured (batch-1
greedy decode of --tokens tokens after a --context-token prompt (16 by default; a longer one, say 1,000,
weighs the decode attention over the KV cache in too); prefill of each --prefill length, timed to
its first token, at the largest thread count only) and stopped; each figure is the best of --rounds.
trtedge's bundle is built by a child of its own before the rounds, so building is not in its RSS.
``--baseline DIR`` adds a third engine, the trtedge of another checkout (``git worktree add DIR COMMIT``),
measured in the same turns with a bundle cache of its own: a change's before and after next to the
same llama.cpp figures, on a machine whose speed drifts between runs.
"decode GB/s" is the weight bytes one decode step reads (every linear layer and the output
projection; the engine's own storage of them) times decode tokens/s, next to the machine's copy
bandwidth (read + written bytes of a 256 MiB torch copy, best of 5) at the same thread count.
Memory: each engine's peak RSS next to the GGUF file's size and its KV cache's (2,048 positions:
trtedge's pool in --kv-cache-dtype, float32 by default; llama.cpp's float16 cache of n_ctx 2,048),
and the ratio peak RSS / (file + KV) against the issue's target of 1.15; trtedge's RSS right after
loading (before any prompt) is shown too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_decode import LLAMA_CPP_CHILD, llama_cpp_python  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASELINE = "trtedge (baseline)"


@dataclass(frozen=True)
class Geometry:
    name: str
    arch: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    bias: bool
    theta: float


GEOMETRIES = {
    "1b": Geometry("Llama-3.2-1B", "llama", 2048, 8192, 16, 32, 8, 128256, True, False, 500000.0),
    "3b": Geometry("Qwen2.5-3B", "qwen2", 2048, 11008, 36, 16, 2, 151936, True, True, 1000000.0),
    "8b": Geometry("Llama-3-8B", "llama", 4096, 14336, 32, 32, 8, 128256, False, False, 500000.0),
}

# GGUF type of each tensor kind, per file format: "linear" (attn_q/k/o, ffn_gate/up), "v_down"
# (attn_v, ffn_down: Q4_K_M keeps them in Q6_K) and "embed" (token_embd and output).
FORMATS = {
    "q4_0": {"linear": "Q4_0", "v_down": "Q4_0", "embed": "Q8_0"},
    "q4_k_m": {"linear": "Q4_K", "v_down": "Q6_K", "embed": "Q6_K"},
    "q8_0": {"linear": "Q8_0", "v_down": "Q8_0", "embed": "Q8_0"},
    "q5_k": {"linear": "Q5_K", "v_down": "Q5_K", "embed": "Q8_0"},
    "q6_k": {"linear": "Q6_K", "v_down": "Q6_K", "embed": "Q6_K"},
}

# bytes per block, elements per block, and where the float16 scales sit (offset, value)
_BLOCKS = {
    "Q4_0": (18, 32, [(0, 0.02 / 8)]),
    "Q8_0": (34, 32, [(0, 0.02 / 64)]),
    "Q4_K": (144, 256, [(0, 0.02 / 256), (2, 0.02 / 512)]),
    "Q5_K": (176, 256, [(0, 0.02 / 512), (2, 0.02 / 1024)]),
    "Q6_K": (210, 256, [(208, 0.02 / 1024)]),
}


def _quantized(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random block bytes [rows, blocks * size] with fixed, realistic float16 scales."""
    size, per, scales = _BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for offset, value in scales:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of ``size`` tokens: the 256 byte characters, then two- and
    three-character tokens, each with the merge that makes it; the last token is the EOS."""
    from trtedge.runtime.text.byte_level import BYTE_CHARS

    chars = [BYTE_CHARS[b] for b in range(256)]
    tokens, merges = list(chars), []
    for a in chars:
        for b in chars:
            if len(tokens) >= size - 1:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    pairs = tokens[256:]
    for ab in pairs:
        for c in chars:
            if len(tokens) >= size - 1:
                break
            tokens.append(ab + c)
            merges.append(f"{ab} {c}")
        if len(tokens) >= size - 1:
            break
    tokens.append("<|eos|>")
    types = [1] * (size - 1) + [3]
    return tokens, types, merges


def write_gguf(path: Path, geo: Geometry, fmt: str, seed: int = 0) -> None:
    """A random-weight GGUF file of ``geo`` in ``fmt``, written one tensor at a time."""
    import gguf

    types = FORMATS[fmt]
    head_dim = geo.hidden // geo.heads
    specs: list[tuple[str, str | None, tuple[int, int] | int]] = [
        ("token_embd.weight", types["embed"], (geo.vocab, geo.hidden))
    ]
    for i in range(geo.layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", None, geo.hidden)]
        for part, rows, kind in (
            ("attn_q", geo.heads * head_dim, "linear"),
            ("attn_k", geo.kv_heads * head_dim, "linear"),
            ("attn_v", geo.kv_heads * head_dim, "v_down"),
        ):
            specs.append((p + part + ".weight", types[kind], (rows, geo.hidden)))
            if geo.bias:
                specs.append((p + part + ".bias", None, rows))
        specs += [
            (p + "attn_output.weight", types["linear"], (geo.hidden, geo.heads * head_dim)),
            (p + "ffn_norm.weight", None, geo.hidden),
            (p + "ffn_gate.weight", types["linear"], (geo.inter, geo.hidden)),
            (p + "ffn_up.weight", types["linear"], (geo.inter, geo.hidden)),
            (p + "ffn_down.weight", types["v_down"], (geo.hidden, geo.inter)),
        ]
    specs.append(("output_norm.weight", None, geo.hidden))
    if not geo.tied:
        specs.append(("output.weight", types["embed"], (geo.vocab, geo.hidden)))

    writer = gguf.GGUFWriter(str(path), geo.arch)
    writer.add_name(f"random {geo.name} {fmt}")
    writer.add_block_count(geo.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(geo.hidden)
    writer.add_feed_forward_length(geo.inter)
    writer.add_head_count(geo.heads)
    writer.add_head_count_kv(geo.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(geo.theta)
    writer.add_vocab_size(geo.vocab)
    tokens, token_types, merges = _vocab(geo.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(geo.vocab - 1)
    writer.add_eos_token_id(geo.vocab - 1)
    writer.add_add_bos_token(False)
    for name, kind, shape in specs:
        if kind is None:
            writer.add_tensor_info(name, (shape,), np.dtype(np.float32), shape * 4)
        else:
            size, per, _ = _BLOCKS[kind]
            rows, cols = shape
            nbytes = rows * cols // per * size
            writer.add_tensor_info(
                name,
                (rows, cols // per * size),
                np.dtype(np.uint8),
                nbytes,
                raw_dtype=gguf.GGMLQuantizationType[kind],
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, kind, shape in specs:
        if kind is None:
            values = (
                np.ones(shape, np.float32) if name.endswith("norm.weight") else rng.normal(0, 0.02, shape)
            )
            writer.write_tensor_data(values.astype(np.float32))
        else:
            writer.write_tensor_data(_quantized(rng, kind, *shape))
    writer.close()


def decode_bytes(path: Path) -> int:
    """Bytes of the GGUF tensors one decode step reads: the linear layers and the output projection
    (the token embedding when the output is tied to it)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(int(t.n_bytes) for t in tensors.values())


KV_POSITIONS = 2048  # each engine's KV cache: trtedge's max_kv_cache_capacity, llama.cpp's n_ctx
RSS_TARGET = 1.15  # the target: peak RSS <= 1.15 x (GGUF file + KV cache)


def llama_cpp_kv_bytes(geo: Geometry) -> int:
    """llama.cpp's KV cache at n_ctx KV_POSITIONS: float16 keys and values of every layer."""
    return KV_POSITIONS * geo.layers * 2 * geo.kv_heads * (geo.hidden // geo.heads) * 2


# The trtedge child: loads the model once, then answers one JSON request per stdin line.
TRTEDGE_CHILD = r"""
import json, sys
args = json.loads(sys.argv[1])
import torch
torch.set_num_threads(args["threads"])
from trtedge import LLM, SamplingParams
llm = LLM(args["model"], cache_dir=args["cache"], weights=args["weights"], max_kv_cache_capacity=args["kv_positions"],
          max_input_len=args["max_input"], engine_process=False, kv_cache_dtype=args["kv_cache_dtype"])
info = llm.describe()
rss = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmRSS:"))
print(json.dumps({"version": "trtedge", "weight_bytes": info["weight_bytes"],
                  "kv_bytes": llm.stats().kv_cache_bytes, "rss_loaded": rss}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    metrics = []
    params = SamplingParams(max_tokens=req["n"], temperature=0, ignore_eos=True)
    out = llm.generate(req["ids"], params, on_metrics=metrics.append)
    if not metrics:
        sys.exit(f"no metrics for a request: finish_reason {out.finish_reason}, engine {llm.stats().engine_error}")
    print(json.dumps({"prefill_s": metrics[0].prefill_time, "decode": metrics[0].decode_tokens_per_second}),
          flush=True)
llm.close()
"""


class Child:
    """An engine in a child process speaking the JSON-lines protocol of ``cpu_decode.py``'s llama.cpp child."""

    def __init__(self, argv: list[str], threads: int, env: dict | None = None, cwd: Path = REPO):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,  # `python -c` imports from its working directory first: this repository's trtedge
        )
        self.hello = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                err = self.proc.stderr.read().strip()[-600:]
                signal = f" (signal {-code})" if code < 0 else ""
                raise RuntimeError(f"child exited with status {code}{signal}: {err or 'no output'}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, ids: list[int], n: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def peak_rss(self) -> int:
        """VmHWM of the child, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def start_trtedge(
    model: Path,
    cache: Path,
    threads: int,
    max_input: int,
    weights: str,
    kv_cache_dtype: str = "auto",
    repo: Path = REPO,
) -> Child:
    """``repo``: the checkout whose trtedge the child imports (``--baseline``: another commit's)."""
    args = {
        "model": str(model),
        "cache": str(cache),
        "threads": threads,
        "max_input": max_input,
        "weights": weights,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_positions": KV_POSITIONS,
    }
    env = {
        "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TRTEDGE_CACHE_DIR": str(cache),
    }
    return Child([sys.executable, "-c", TRTEDGE_CHILD, json.dumps(args)], threads, env, cwd=repo)


def start_llama_cpp(python: Path, model: Path, threads: int) -> Child:
    return Child(
        [str(python), "-c", LLAMA_CPP_CHILD, json.dumps({"model": str(model), "threads": threads})], threads
    )


def copy_bandwidth(threads: int, mib: int = 256) -> float:
    """Read + written GB/s of a torch copy of ``mib`` MiB, best of 5."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**18, dtype=torch.float32)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(old)
    return 2 * a.numel() * 4 / best / 1e9


def measure(child: Child, decode_ids: list[int], prefills: dict[int, list[int]], tokens: int) -> dict:
    child.ask(decode_ids, 4)  # warm-up: pages in the weights, sizes the buffers
    child.ask(decode_ids[:16] * 2, 1)
    out = {"decode": child.ask(decode_ids, tokens)["decode"]}
    for n, ids in prefills.items():
        out[f"prefill_{n}"] = n / child.ask(ids, 1)["prefill_s"]
    out["rss"] = child.peak_rss()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--geometry", default="1b", help="comma-separated: " + ", ".join(GEOMETRIES))
    parser.add_argument("--format", default="q4_0", help="comma-separated: " + ", ".join(FORMATS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prefill", default="128,1024", help="prompt lengths, at the largest thread count")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per decode measurement")
    parser.add_argument(
        "--context", type=int, default=16, help="the decode measurement's prompt length (its KV context)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="for the GGUF files and trtedge's bundles"
    )
    parser.add_argument(
        "--llama-venv", type=Path, default=Path(os.environ.get("LLAMA_CPP_VENV", "/work/bench-venv"))
    )
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout of trtedge (say a git worktree of an earlier commit), measured in the same "
        "turns as a third engine with its own bundle cache",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp16", "int8"], help="trtedge's KV cache"
    )
    args = parser.parse_args()
    geometries = [GEOMETRIES[g] for g in args.geometry.split(",")]
    formats = args.format.split(",")
    if unknown := [f for f in formats if f not in FORMATS]:
        parser.error(f"--format: unknown {', '.join(unknown)} (choose from {', '.join(FORMATS)})")
    threads = sorted(int(t) for t in args.threads.split(","))
    lengths = [int(n) for n in args.prefill.split(",")]
    if not 1 <= args.context <= KV_POSITIONS - args.tokens - 8:
        parser.error(f"--context: 1 to {KV_POSITIONS - args.tokens - 8} (the KV caches hold {KV_POSITIONS})")
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        run(args, Path(tmp), geometries, formats, threads, lengths)


def run(args, work: Path, geometries, formats, threads, lengths) -> None:
    started, load_start = time.time(), os.getloadavg()
    python, why = (None, "--skip-llama-cpp") if args.skip_llama_cpp else llama_cpp_python(args.llama_venv)
    bandwidth = {t: copy_bandwidth(t) for t in threads}
    rng = np.random.default_rng(1)
    rows = []
    for geo in geometries:
        decode_ids = rng.integers(0, 60000, args.context).tolist()
        prefills = {n: rng.integers(0, 60000, n).tolist() for n in lengths}
        for fmt in formats:
            path = work / f"{geo.name}-{fmt}.gguf"
            t0 = time.time()
            write_gguf(path, geo, fmt)
            print(
                f"wrote {path.name}: {path.stat().st_size / 2**30:.2f} GiB in {time.time() - t0:.0f} s",
                file=sys.stderr,
            )
            t0 = time.time()
            kv = args.kv_cache_dtype
            start_trtedge(
                path, work / "cache", 1, max(*lengths, args.context) + 8, "auto", kv
            ).close()  # builds the bundle
            print(f"trtedge bundle built in {time.time() - t0:.0f} s", file=sys.stderr)
            starters = {
                "trtedge": lambda t, p=path, kv=kv: start_trtedge(
                    p, work / "cache", t, max(*lengths, args.context) + 8, "auto", kv
                )
            }
            if args.baseline is not None:  # its own cache: its bundle layout may differ
                base = args.baseline
                start_trtedge(
                    path, work / "cache-baseline", 1, max(*lengths, args.context) + 8, "auto", kv, base
                ).close()
                starters[BASELINE] = lambda t, p=path, kv=kv, base=base: start_trtedge(
                    p, work / "cache-baseline", t, max(*lengths, args.context) + 8, "auto", kv, base
                )
            if python is not None:
                starters["llama.cpp"] = lambda t, p=path: start_llama_cpp(python, p, t)
            results: dict[tuple[str, int], list[dict]] = {}
            meta: dict[str, dict] = {}
            failed: dict[str, str] = {} if python is not None else {"llama.cpp": why}
            for _ in range(args.rounds):
                for t in threads:
                    for name, start in starters.items():
                        if name in failed:
                            continue
                        try:
                            child = start(t)
                            try:
                                meta[name] = child.hello
                                lens = prefills if t == threads[-1] else {}
                                results.setdefault((name, t), []).append(
                                    measure(child, decode_ids, lens, args.tokens)
                                )
                            finally:
                                child.close()
                        except RuntimeError as e:
                            failed[name] = str(e)
                        print(
                            f"{geo.name} {fmt} {name} {t} threads: {(results.get((name, t)) or [failed.get(name, '-')])[-1]}",
                            file=sys.stderr,
                        )
            gguf_bytes = decode_bytes(path)
            rows.append((geo, fmt, path.stat().st_size, gguf_bytes, results, meta, failed))
            path.unlink()
    print_table(args, rows, threads, lengths, bandwidth, load_start, time.time() - started)


def print_table(args, rows, threads, lengths, bandwidth, load_start, seconds: float) -> None:
    load = os.getloadavg()
    bw = ", ".join(f"{t} thread{'s' if t > 1 else ''} {bandwidth[t]:.1f} GB/s" for t in threads)
    print(
        f"random-weight GGUF files; batch 1; decode: {args.tokens} new tokens after a {args.context}-token prompt; prefill "
        f"at {threads[-1]} threads; best of {args.rounds} rounds, engines in turns, one alive at a time; "
        f"load average {load_start[0]:.2f} at start, {load[0]:.2f} {load[1]:.2f} at end; {seconds:.0f} s; "
        f"copy bandwidth (read + written) {bw}; trtedge KV cache {args.kv_cache_dtype}; "
        f"RSS target <= {RSS_TARGET} x (file + KV)"
    )
    head = [f"decode tok/s {t}T" for t in threads] + [f"prefill {n} tok/s" for n in lengths]
    print(
        "| model | engine | "
        + " | ".join(head)
        + " | peak RSS GiB | RSS after load GiB | file GiB | KV GiB | peak RSS / (file + KV)"
        + f" | decode GB/s {threads[-1]}T (of copy) |"
    )
    print("|---|---|" + "---:|" * (len(head) + 6))
    for geo, fmt, size, gguf_bytes, results, meta, failed in rows:
        for name in ("llama.cpp", BASELINE, "trtedge"):
            if name == BASELINE and not any(k[0] == name for k in results) and name not in failed:
                continue
            label = f"{geo.name} {fmt.upper()}"
            if name in failed and not any(k[0] == name for k in results):
                print(f"| {label} | {name} | skipped: {failed[name][:200]} |" + " |" * (len(head) + 5))
                continue
            peer = results.get(("llama.cpp", threads[-1])) if name != "llama.cpp" else None
            cells = []
            for t in threads:
                rs = results.get((name, t), [])
                best = max((r["decode"] for r in rs), default=0.0)
                cell = f"{best:.2f}" if rs else "-"
                peer_t = results.get(("llama.cpp", t)) if name != "llama.cpp" else None
                if peer_t and rs:
                    cell += f" ({best / max(r['decode'] for r in peer_t):.2f}x)"
                cells.append(cell)
            top = results.get((name, threads[-1]), [])
            for n in lengths:
                best = max((r.get(f"prefill_{n}", 0.0) for r in top), default=0.0)
                cell = f"{best:.1f}" if best else "-"
                if peer and best:
                    cell += f" ({best / max(r[f'prefill_{n}'] for r in peer):.2f}x)"
                cells.append(cell)
            rss = max((r["rss"] for t in threads for r in results.get((name, t), [])), default=0)
            hello = meta.get(name, {})
            weight = hello.get("weight_bytes") or gguf_bytes
            kv = hello["kv_bytes"] if "kv_bytes" in hello else llama_cpp_kv_bytes(geo)
            loaded = f"{hello['rss_loaded'] / 2**30:.2f}" if "rss_loaded" in hello else "-"
            decode = max((r["decode"] for r in top), default=0.0)
            gbs = weight * decode / 1e9
            print(
                f"| {label} | {name} | " + " | ".join(cells) + f" | {rss / 2**30:.2f} | {loaded} "
                f"| {size / 2**30:.2f} | {kv / 2**30:.2f} | {rss / (size + kv):.2f} "
                f"| {gbs:.1f} ({gbs / bandwidth[threads[-1]]:.0%}) |"
            )
        if failed:
            for name, why in failed.items():
                if any(k[0] == name for k in results):
                    print(f"<!-- {geo.name} {fmt}: {name} failed in a later round: {why[:200]} -->")


if __name__ == "__main__":
    main()
