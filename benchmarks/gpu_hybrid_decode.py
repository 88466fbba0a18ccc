"""Batch-1 decode of hybrid models on a GPU, decode CUDA graphs on and off, in one run.

    python benchmarks/gpu_hybrid_decode.py [--shapes qwen3.5-9b,nemotron-3-nano-30b-a3b]
        [--new-tokens 128] [--modes graphs,fused,unfused,eager] [--profile [--profile-steps 32]] [--fla]

Random bf16 weights (load_format="dummy"): the Qwen3.5 ~9B shape is transformers' default
Qwen3_5TextConfig (24 Gated DeltaNet + 8 gated attention layers); the Nemotron-3-Nano-30B-A3B shape is
52 layers (23 Mamba-2, 23 MoE of 128 experts top-6, 6 attention). A 128-token prompt, greedy, EOS
ignored; each shape loads once: ``fused`` / ``unfused`` capture the graphs again with or without
the fused products, ``eager`` sets the graphs aside (the same kernels, launched one by one). One
JSON line per figure; the bandwidth counts the bytes a token reads: every weight, but of the routed
experts only the ``num_experts_per_tok`` a token picks. ``--profile``: also the CUDA
kernels per decode step and their summed time (torch.profiler over a short generation).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtedge import LLM, SamplingParams  # noqa: E402

PEAK_BYTES_PER_S = 4.8e12  # H200 datasheet

QWEN3_5_9B = dict(
    model_type="qwen3_5_text",
    architectures=["Qwen3_5ForCausalLM"],
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    attention_bias=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
    eos_token_id=2,
    torch_dtype="bfloat16",
)

_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_3_NANO = dict(
    model_type="nemotron_h",
    architectures=["NemotronHForCausalLM"],
    vocab_size=131072,
    hidden_size=2688,
    layers_block_type=[
        {"M": "linear_attention", "E": "moe", "*": "full_attention"}[c] for c in _NANO_PATTERN
    ],
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=1856,
    mlp_hidden_act="relu2",
    mamba_num_heads=64,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    chunk_size=128,
    n_routed_experts=128,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712,
    routed_scaling_factor=2.5,
    max_position_embeddings=262144,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    torch_dtype="bfloat16",
)

MODES = ("graphs", "fused", "unfused", "eager")
SHAPES = {"qwen3.5-9b": QWEN3_5_9B, "nemotron-3-nano-30b-a3b": NEMOTRON_3_NANO}


def inactive_expert_bytes(config: dict) -> int:
    """Bytes of the routed experts a token does not pick (bf16), over all MoE layers."""
    if config["model_type"] != "nemotron_h":
        return 0
    per_expert = 2 * config["hidden_size"] * config["moe_intermediate_size"] * 2
    layers = config["layers_block_type"].count("moe")
    return layers * (config["n_routed_experts"] - config["num_experts_per_tok"]) * per_expert


def write_shape(directory: Path, config: dict) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(config["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    return directory


def decode(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
    metrics = []
    llm.generate(
        prompt,
        SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
        on_metrics=metrics.append,
    )
    return metrics[0].decode_tokens_per_second


def profile(llm: LLM, prompt: list[int], steps: int = 32) -> tuple[float, float]:
    """(CUDA kernels per decode step, their summed time per step in ms), prefill subtracted."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def kernels(max_tokens: int) -> tuple[int, float]:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(events), sum(e.device_time for e in events) / 1e3  # us -> ms

    n1, t1 = kernels(1)
    n2, t2 = kernels(1 + steps)
    return (n2 - n1) / steps, (t2 - t1) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--modes",
        default="graphs,eager",
        help="comma-separated: graphs (the default path), fused / unfused (graphs with the norms, SiLU-mul "
        "and residual adds inside the products, as TRTEDGE_DECODE_FUSION=1, or as kernels of their own), "
        "eager (no graphs, the default path)",
    )
    parser.add_argument(
        "--fla",
        action="store_true",
        help="prompts run fla-core's chunked kernels (when installed); by default the torch reference, "
        "since fla-core's autotuning at start takes longer than a bounded run (decode never uses fla-core)",
    )
    parser.add_argument("--profile", action="store_true", help="kernels per step (graph modes)")
    parser.add_argument("--profile-steps", type=int, default=32)
    args = parser.parse_args()
    if not args.fla:
        from trtedge.runtime.ops import gated_delta

        gated_delta.fla_available = lambda device: False
    prompt = torch.randint(10, 100000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    device = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            config = SHAPES[name]
            directory = write_shape(Path(tmp) / name, config)
            start = time.perf_counter()
            with LLM(
                str(directory),
                load_format="dummy",
                dtype="bfloat16",
                device="cuda",
                max_kv_cache_capacity=1024,
                max_input_len=512,
                engine_process=False,  # the eager mode sets the runner's graphs aside (one load for both)
            ) as llm:
                runner, model = llm.engine.runner, llm.model
                # loading, warm-up compiles and graph capture: what a bounded run has to leave room for
                ready = dict(figure="ready", shape=name, seconds=round(time.perf_counter() - start, 1))
                print(json.dumps(ready), flush=True)
                graphs, default = runner.graphs, model.fused_products
                for mode in args.modes.split(","):
                    if mode not in MODES:
                        raise SystemExit(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
                    fused = {"fused": True, "unfused": False}.get(mode, default) and model.can_fuse_products
                    if model.fused_products != fused:  # the graphs recorded the other path
                        model.fused_products = fused
                        with torch.inference_mode():  # as the engine's steps
                            graphs.recapture()
                    runner.graphs = None if mode == "eager" else graphs
                    tps = decode(llm, prompt, args.new_tokens)
                    nbytes = llm.describe()["weight_bytes"]
                    active = nbytes - inactive_expert_bytes(config)
                    row = dict(
                        figure="batch1_decode",
                        shape=name,
                        mode=mode,
                        cuda_graphs=mode != "eager",
                        fused_products=model.fused_products,
                        device=device,
                        tokens_per_s=round(tps, 1),
                        weight_gb=round(nbytes / 1e9, 2),
                        active_weight_gb=round(active / 1e9, 2),
                        achieved_gb_s=round(tps * active / 1e9, 1),
                        pct_of_peak=round(100 * tps * active / PEAK_BYTES_PER_S, 1),
                    )
                    print(json.dumps(row), flush=True)
                    if args.profile and mode != "eager":
                        per_step, ms = profile(llm, prompt, args.profile_steps)
                        step = dict(figure="decode_step_profile", shape=name, mode=mode)
                        step.update(kernels_per_step=round(per_step, 1), kernel_ms_per_step=round(ms, 3))
                        print(json.dumps({**step, "wall_ms_per_step": round(1e3 / tps, 3)}), flush=True)
            del llm, runner, model, graphs  # the next shape loads into the memory this one held
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
