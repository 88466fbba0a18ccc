"""Batch-1 decode and long-prompt prefill on a GPU: trtedge, a torch.compile peer and HF transformers,
same shapes, one run.

    python benchmarks/gpu_decode.py [--shapes qwen3-0.6b,qwen3-8b,llama-1b,llama-8b,qwen3-30b-a3b]
        [--new-tokens 256] [--no-hf] [--no-peer] [--variants pdl,fused] [--prefill-len 0] [--batches 8,16]

Random bf16 weights (load_format="dummy") with Qwen3 / Llama shapes (``benchmarks/shapes.py``), a
128-token prompt, greedy, EOS ignored. The peer is ``benchmarks/compiled_peer.py``: a gpt-fast-style
static-cache decoder under ``torch.compile(mode="reduce-overhead")``. Prints one JSON line per
figure. Achieved bandwidth = weight bytes x tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compiled_peer import peer_decode  # noqa: E402
from benchmarks.shapes import QWEN3_MOE, shape_config, write_shape  # noqa: E402
from trtedge import LLM, SamplingParams  # noqa: E402

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def trtedge_decode(
    directory: Path, prompt: list[int], new_tokens: int, batches: tuple[int, ...] = ()
) -> tuple[float, int, dict[int, float]]:
    """(batch-1 decode tok/s, weight bytes, {batch: decode tok/s of all its sequences together})
    in one engine: each larger batch decodes ``batch`` prompts (differing in their first token, so no
    prefix is shared) submitted together."""
    with LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_kv_cache_capacity=max(1024, max((1, *batches)) * (len(prompt) + new_tokens + 64)),
        max_input_len=512,
        **(dict(enable_in_flight_batching=True, max_batch_size=max(batches)) if batches else {}),
    ) as llm:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
        metrics = []
        llm.generate(prompt, params, on_metrics=metrics.append)
        batched = {}
        for batch in batches:
            prompts = [[10 + i] + prompt[1:] for i in range(batch)]
            llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            each = []
            llm.generate(prompts, params, on_metrics=each.append)
            batched[batch] = sum(m.decode_tokens_per_second for m in each)
        return metrics[0].decode_tokens_per_second, llm.describe()["weight_bytes"], batched


def trtedge_prefill(directory: Path, length: int) -> float:
    with LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_kv_cache_capacity=length + 16,
        max_input_len=length,
        max_num_batched_tokens=length,
    ) as llm:
        prompt = torch.randint(10, 150000, (length,)).tolist()
        llm.generate(prompt[:512], SamplingParams(max_tokens=1))
        metrics = []
        llm.generate(prompt, SamplingParams(max_tokens=1), on_metrics=metrics.append)
        return length / metrics[0].prefill_time


def hf_decode(name: str, prompt: list[int], new_tokens: int) -> float:
    import transformers

    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in shape_config(name).items() if k != "architectures"}
    )
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=16, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start - prefill
    del model
    torch.cuda.empty_cache()
    return (new_tokens - 1) / elapsed


VARIANTS = {
    "pdl": {"TRTEDGE_PDL": "1"},
    "fused": {"TRTEDGE_PDL": "1", "TRTEDGE_DECODE_FUSION": "1"},
    "fused-no-pdl": {"TRTEDGE_DECODE_FUSION": "1"},
    "moe-decode": {"TRTEDGE_MOE_DECODE": "1"},
    "epilogues": {"TRTEDGE_DECODE_EPILOGUES": "1"},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-peer", action="store_true", help="skip the torch.compile peer")
    parser.add_argument(
        "--variants",
        default="",
        help="also trtedge with: pdl (TRTEDGE_PDL=1), fused (TRTEDGE_DECODE_FUSION=1 TRTEDGE_PDL=1), "
        "fused-no-pdl (TRTEDGE_DECODE_FUSION=1), moe-decode (TRTEDGE_MOE_DECODE=1), epilogues (TRTEDGE_DECODE_EPILOGUES=1), "
        "comma-separated",
    )
    parser.add_argument(
        "--batches", default="", help="also decode these batch sizes in the same engines, e.g. 8,16"
    )
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    prompt = torch.randint(10, 128000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    device = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            directory = write_shape(Path(tmp) / name, name)
            tps, nbytes, batched = trtedge_decode(directory, prompt, args.new_tokens, batches)
            gbs = tps * nbytes / 1e9
            emit(
                figure="batch1_decode",
                engine="trtedge",
                shape=name,
                device=device,
                tokens_per_s=round(tps, 1),
                weight_gb=round(nbytes / 1e9, 3),
                achieved_gb_s=round(gbs, 1),
                pct_of_peak=round(100 * gbs * 1e9 / PEAK_BYTES_PER_S, 1),
            )
            for batch, total in batched.items():
                emit(
                    figure="batch_decode",
                    engine="trtedge",
                    shape=name,
                    batch=batch,
                    tokens_per_s=round(total, 1),
                )
            for variant in filter(None, args.variants.split(",")):
                engine, env = f"trtedge-{variant}", VARIANTS[variant]
                os.environ.update(env)
                try:
                    other, _, other_batched = trtedge_decode(directory, prompt, args.new_tokens, batches)
                finally:
                    for key in env:
                        del os.environ[key]
                for batch, total in other_batched.items():
                    emit(
                        figure="batch_decode", engine=engine, shape=name, batch=batch,
                        tokens_per_s=round(total, 1), speedup_vs_default=round(total / batched[batch], 2),
                    )  # fmt: skip
                emit(
                    figure="batch1_decode",
                    engine=engine,
                    shape=name,
                    tokens_per_s=round(other, 1),
                    achieved_gb_s=round(other * nbytes / 1e9, 1),
                    speedup_vs_default=round(other / tps, 2),
                )
            if not args.no_hf:
                hf = hf_decode(name, prompt, args.new_tokens)
                emit(
                    figure="batch1_decode",
                    engine="hf-transformers",
                    shape=name,
                    tokens_per_s=round(hf, 1),
                    trtedge_speedup=round(tps / hf, 1),
                )
            if not args.no_peer and name not in QWEN3_MOE:  # the peer is a dense decoder
                try:
                    peer = peer_decode(name, prompt, args.new_tokens)
                    emit(
                        figure="batch1_decode",
                        engine="torch-compile-peer",
                        shape=name,
                        tokens_per_s=round(peer, 1),
                        achieved_gb_s=round(peer * nbytes / 1e9, 1),
                        trtedge_ratio=round(tps / peer, 2),
                    )
                except Exception as e:  # report, keep going
                    emit(figure="batch1_decode", engine="torch-compile-peer", shape=name, error=repr(e)[:300])
        if args.prefill_len <= 0:
            return
        directory = write_shape(Path(tmp) / "prefill", "qwen3-0.6b")
        emit(
            figure="prefill",
            engine="trtedge",
            shape="qwen3-0.6b",
            prompt_tokens=args.prefill_len,
            tokens_per_s=round(trtedge_prefill(directory, args.prefill_len), 1),
        )


if __name__ == "__main__":
    main()
