"""Nemotron-H (Mamba-2 + attention + MLP + routed MoE layers) against HF transformers, and its
recurrent state in the engine: slots per sequence, batched decode, preemption, context reuse,
speculative rollback."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.spec_helpers import generate, load, repetitive_prompts
from tests.test_engine import in_threads
from tests.tiny import make_tiny_nemotron_h_checkpoint
from trtedge import LLM, ContextCacheConfig, SamplingParams
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.models.config import ModelConfig, UnsupportedModelError
from trtedge.runtime.ops import cpu_kernels, ssd
from trtedge.runtime.speculative import SpeculativeConfig

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return make_tiny_nemotron_h_checkpoint(tmp_path_factory.mktemp("nemotron_h") / "m")


def nemotron_llm(path, **options) -> LLM:
    return LLM(
        str(path), **{"dtype": "float32", "max_kv_cache_capacity": 512, "max_input_len": 256, **options}
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy_choices(hf, ids: list[int], output: list[int]) -> list[int]:
    """HF's greedy pick after the prompt and after each of our tokens, in one forward pass: equal to
    ``output`` exactly when HF's own greedy generation would produce ``output`` (by induction)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + output])).logits[0]
    return logits[len(ids) - 1 : -1].argmax(-1).tolist()


def test_greedy_64_tokens_match_transformers_with_every_layer_type(nemotron):
    hf = transformers.AutoModelForCausalLM.from_pretrained(nemotron, dtype=torch.float32).eval()
    assert [b.block_type for b in hf.model.layers] == ["linear_attention", "moe", "full_attention", "mlp"]
    # both longer than the 16-token scan chunk; the long one also prefills in 3 steps of 64 tokens
    prompts = [prompt(24, 1), prompt(150, 2)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with nemotron_llm(nemotron, max_num_batched_tokens=64) as llm:
        got = [llm.generate(ids, params).token_ids for ids in prompts]
    assert all(len(out) == 64 for out in got)
    assert all(len(set(out)) > 4 for out in got)  # not one token repeated: the state carries information
    assert [hf_greedy_choices(hf, ids, out) for ids, out in zip(prompts, got)] == got


def test_chunked_scan_equals_the_recurrent_update_with_a_carried_state():
    g = torch.Generator().manual_seed(0)
    t, h, p, n = 70, 4, 8, 6
    x, b, c = (torch.randn(t, h, d, generator=g) for d in (p, n, n))
    dt, a = torch.rand(t, h, generator=g) * 0.5, -torch.rand(h, generator=g) - 0.1
    state = torch.randn(h, p, n, generator=g)
    out, final = ssd.chunk_scan(x, dt, a, b, c, state, chunk=16)
    s, steps = state.unsqueeze(0), []
    for i in range(t):
        o, s = ssd.recurrent_step(x[i : i + 1], dt[i : i + 1], a, b[i : i + 1], c[i : i + 1], s)
        steps.append(o[0])
    assert torch.allclose(out, torch.stack(steps), atol=1e-4) and torch.allclose(final, s[0], atol=1e-4)


def test_batched_decode_of_8_requests_equals_each_alone(nemotron):
    prompts = [prompt(n, 10 + n) for n in (5, 17, 33, 64, 70, 9, 100, 41)]
    with nemotron_llm(nemotron) as llm:
        alone = [llm.generate(p, GREEDY).token_ids for p in prompts]
    with nemotron_llm(nemotron, enable_in_flight_batching=True, max_batch_size=8) as llm:
        together = in_threads(lambda p: llm.generate(p, GREEDY).token_ids, prompts)
        stats = llm.stats()
    assert together == alone
    assert stats["steps"] < 8 * 16  # decoded together
    assert stats["state_slots_total"] == 8 and stats["state_slots_free"] == 8


def test_preemption_recomputes_and_frees_every_state_slot(nemotron):
    prompts = [prompt(20, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with nemotron_llm(nemotron) as llm:
        expected = [llm.generate(p, params).token_ids for p in prompts]
        config = EngineConfig(
            max_batch_size=4, max_kv_cache_capacity=64, enable_in_flight_batching=True, num_blocks=6
        )
        engine = Engine(llm.model, llm.tokenizer, config)
    try:
        streams = [engine.submit(p, params) for p in prompts]
        outs = [[t for d in s for t in d.token_ids] for s in streams]
        assert engine.stats.preemptions > 0
        assert outs == expected
        assert engine.blocks.state.num_free_slots == 4 and engine.blocks.num_free_blocks == 6
    finally:
        engine.shutdown()


def test_a_repeated_prompt_reuses_its_prefix_snapshot_with_unchanged_output(nemotron):
    ids = prompt(70, 7)
    reuse = ContextCacheConfig(enabled=True)
    with nemotron_llm(nemotron, context_cache_config=reuse) as warm, nemotron_llm(nemotron) as cold:
        first = warm.generate(ids, GREEDY)
        again = warm.generate(ids + [5, 6, 7], GREEDY)
        reference = cold.generate(ids + [5, 6, 7], GREEDY)
        metrics = warm.get_context_cache_metrics()
        assert warm.stats()["state_slots_free"] == warm.stats()["state_slots_total"]
    assert first.metrics.reused_tokens == 0
    assert again.metrics.reused_tokens == 64  # the prompt's last block-aligned prefix
    assert again.token_ids == reference.token_ids
    assert reference.metrics.reused_tokens == 0
    assert metrics.recurrent_snapshots >= 1 and metrics.hits == 1


def test_ngram_speculation_rolls_the_state_back_to_plain_greedy(nemotron):
    model, tokenizer = load(nemotron)
    prompts = repetitive_prompts(4)
    plain, _ = generate(model, tokenizer, prompts, batch=1)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    outs, engine = generate(model, tokenizer, prompts, speculative=spec, batch=4)
    assert outs == plain
    assert engine.speculative.stats.draft_tokens > 0
    assert engine.blocks.state.num_free_slots == engine.blocks.state.num_slots


def test_layer_types_are_read_from_the_pattern_or_legacy_names_and_unknown_ones_refused(nemotron):
    base = {"model_type": "nemotron_h", "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4}
    pattern = ModelConfig.from_hf({**base, "hybrid_override_pattern": "M-M*E"})
    legacy = ModelConfig.from_hf({**base, "layers_block_type": ["mamba", "mlp", "mamba", "attention", "moe"]})
    for cfg in (pattern, legacy):
        assert cfg.num_layers == 5
        assert cfg.text_config["layers_block_type"] == [
            "linear_attention",
            "mlp",
            "linear_attention",
            "full_attention",
            "moe",
        ]
    with pytest.raises(UnsupportedModelError, match="layers_block_type: unknown layer type.*'conv'"):
        ModelConfig.from_hf({**base, "layers_block_type": ["mamba", "conv"]})
    with pytest.raises(UnsupportedModelError, match="hybrid_override_pattern: unknown layer code.*'X'"):
        ModelConfig.from_hf({**base, "hybrid_override_pattern": "M-X"})
    with pytest.raises(UnsupportedModelError, match="'layers_block_type'"):
        ModelConfig.from_hf(base)


def test_dummy_weights_load_for_benchmarks(nemotron):
    with nemotron_llm(nemotron, load_format="dummy") as llm:
        assert len(llm.generate([5, 6, 7], GREEDY).token_ids) == 16
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]


def test_a_nemotron_h_draft_model_is_refused_before_loading(nemotron):
    from trtedge.runtime.speculative import UnsupportedSpeculativeMethod, check_draft

    cfg = ModelConfig.from_hf(json.loads((nemotron / "config.json").read_text()))
    with pytest.raises(UnsupportedSpeculativeMethod, match="hybrid draft model \\(nemotron_h"):
        check_draft(cfg)


def test_latent_experts_and_mtp_weights_load_and_match_transformers(tmp_path, caplog):
    """Nemotron-3-Super's shape: experts in a latent space (fc1/fc2 latent projections around them);
    its multi-token-prediction layers (``mtp.*``) are skipped with a log line."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_nemotron_h_checkpoint(
        tmp_path / "m",
        moe_latent_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = load_file(path / "model.safetensors")
    assert "backbone.layers.1.mixer.fc1_latent_proj.weight" in weights
    save_file({**weights, "mtp.layers.0.norm.weight": torch.ones(64)}, path / "model.safetensors")
    ids = prompt(40, 3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with caplog.at_level("INFO", logger="trtedge"), nemotron_llm(path) as llm:
        out = llm.generate(ids, params).token_ids
    assert hf_greedy_choices(hf, ids, out) == out
    assert "skipped 1 multi-token-prediction tensors" in caplog.text


NEMOTRON_LINEARS = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "modelopt-fp8"])
def test_nvfp4_and_fp8_checkpoints_serve_the_dequantized_models_greedy_tokens(nemotron, tmp_path, fmt):
    """ModelOpt's NVFP4 (the format of NVIDIA's Nemotron Omni NVFP4 checkpoint) and FP8: every Mamba,
    attention, MLP and expert projection quantized; recognised from the quantization config and run
    dequantized, with the greedy tokens and prompt logprobs of the float model those weights stand for
    (the logprobs tell it from the original float model, whose greedy tokens this tiny model keeps)."""
    from tests.runtime.prequantized_tiny import write_dequantized, write_prequantized
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.artifacts.quantize import QuantizedTensor

    path, reference = write_prequantized(nemotron, tmp_path / "q", fmt, NEMOTRON_LINEARS)
    assert len(reference) == 18  # in/out x 1, 4 experts + shared x 2, q/k/v/o, the MLP's 2
    checkpoint = resolve_checkpoint(str(path))
    assert checkpoint.scheme.method == ("nvfp4" if fmt == "modelopt-nvfp4" else "fp8")
    quantized = {n for n, t in checkpoint.iter_tensors() if isinstance(t, QuantizedTensor)}
    assert quantized == set(reference)
    dequantized = write_dequantized(nemotron, tmp_path / "float", reference)
    ids = prompt(40, 9)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
    tokens, logprobs = [], []
    for model in (dequantized, path, nemotron):
        with nemotron_llm(model, cache_dir=str(tmp_path / "cache")) as llm:
            out = llm.generate(ids, params)
            assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
        tokens.append(out.token_ids)
        logprobs.append(torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]]))
    assert tokens[1] == tokens[0]
    assert (logprobs[1] - logprobs[0]).abs().max() < 1e-5
    assert (logprobs[1] - logprobs[2]).abs().max() > 1e-3  # not the original weights (0.02-0.07 off)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the native CPU kernels")
def test_quantized_weights_given_to_the_model_run_in_their_format_or_dequantized(nemotron):
    """What a pre-quantized checkpoint on CUDA hands the model (there: fp8): its projections run as
    quantized layers (the fused q/k/v one too), the router, the embedding and the experts of the float
    grouped kernel dequantized; here int8 on the CPU, against the model of the same weights dequantized."""
    from safetensors.torch import load_file

    from trtedge.runtime.artifacts.quantize import QuantizedTensor, quantize
    from trtedge.runtime.models.nemotron_h import NemotronHModel
    from trtedge.runtime.ops.linear import Int8Linear

    cfg = ModelConfig.from_hf(json.loads((nemotron / "config.json").read_text()))
    floats = load_file(str(nemotron / "model.safetensors"))
    quantized = {
        n: quantize(t, "int8") if t.dim() == 2 and n.endswith(".weight") else t for n, t in floats.items()
    }
    dequantized = {n: t.dequantize() if isinstance(t, QuantizedTensor) else t for n, t in quantized.items()}
    cpu = torch.device("cpu")
    model = NemotronHModel(cfg, quantized.items(), torch.float32, cpu)
    reference = NemotronHModel(cfg, dequantized.items(), torch.float32, cpu)
    assert isinstance(model.layers[0].mixer.in_proj, Int8Linear)
    assert isinstance(model.layers[2].mixer.qkv, Int8Linear)
    assert isinstance(model.layers[1].mixer.experts[0].up, Int8Linear)  # the CPU's per-expert loop
    assert model.layers[1].mixer.router.dtype == torch.float32 and model.embed.dtype == torch.float32
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint

    tokenizer = resolve_checkpoint(str(nemotron)).load_tokenizer()
    prompts = [prompt(40, 5)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert (
        generate(model, tokenizer, prompts, params)[0] == generate(reference, tokenizer, prompts, params)[0]
    )
