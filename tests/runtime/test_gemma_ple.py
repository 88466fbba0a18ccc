"""Gemma 3n and Gemma 4 text (per-layer embeddings, KV sharing, AltUp / LAuReL, per-layer head sizes)
against HF transformers on tiny random checkpoints, and the PLE table resident or in a bounded pool."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.runtime.test_models import prefill_logits
from tests.test_engine import in_threads
from tests.tiny import PLE_FAMILIES, PLE_VOCAB, make_tiny_ple_checkpoint
from trtedge import LLM, ConfigError, PleRuntimeConfig, SamplingParams
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.models import load_model
from trtedge.runtime.models.ple import PleCapacityError, plan_pieces, split_batch
from trtedge.runtime.ops.attention import AttentionBatch

transformers = pytest.importorskip("transformers")

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(PLE_FAMILIES))
def tiny(request, tmp_path_factory):
    path = make_tiny_ple_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, PLE_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy_choices(hf, ids: list[int], output: list[int]) -> list[int]:
    """HF's greedy pick after the prompt and after each of our tokens (one forward, no cache): equal to
    ``output`` exactly when HF's own greedy generation gives ``output``."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + output])).logits[0]
    return logits[len(ids) - 1 : -1].argmax(-1).tolist()


def tiny_llm(path, **options) -> LLM:
    return LLM(
        str(path),
        **{
            "dtype": "float32",
            "device": "cpu",
            "max_kv_cache_capacity": 256,
            "max_input_len": 128,
            **options,
        },
    )


def test_prefill_logits_past_the_window_match_transformers(tiny):
    family, path, hf = tiny
    ids = prompt(40, 1)  # 5 x the sliding window
    model = load_model(
        resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights="float", max_positions=256
    )
    assert model.num_kv_layers == 2 and model.cache_index == {0: 0, 1: 1, 2: 0, 3: 1}  # 2 layers share
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (prefill_logits(model, ids) - ref).abs().max().item()
    print(f"{family}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-4


def test_greedy_64_tokens_match_transformers_and_batched_equals_alone(tiny):
    family, path, hf = tiny
    prompts = [prompt(n, 10 + n) for n in (30, 5, 44)]
    with tiny_llm(path) as llm:
        alone = [llm.generate(p, GREEDY_64).token_ids for p in prompts]
    assert all(len(out) == 64 for out in alone)
    assert [hf_greedy_choices(hf, p, out) for p, out in zip(prompts, alone)] == alone
    with tiny_llm(path, enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=32) as llm:
        together = in_threads(lambda p: llm.generate(p, GREEDY_64).token_ids, prompts)
        stats = llm.stats()
    assert together == alone
    assert stats["steps"] < 3 * 64  # decoded together
    assert stats["ple_cache"]["residency"] == "resident"


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_the_multimodal_checkpoint_serves_its_text_model(family, tmp_path):
    """config.json of Gemma3nForConditionalGeneration / Gemma4ForConditionalGeneration: the text config
    under text_config, its tensors under model.language_model., towers skipped."""
    from safetensors.torch import load_file, save_file

    text = make_tiny_ple_checkpoint(tmp_path / "text", family)
    config = json.loads((text / "config.json").read_text())
    mm = tmp_path / "mm"
    mm.mkdir()
    (mm / "config.json").write_text(json.dumps({"model_type": family, "text_config": config}))
    tensors = {
        n.replace("model.", "model.language_model.", 1): t
        for n, t in load_file(text / "model.safetensors").items()
        if n != "lm_head.weight"
    }
    tensors["model.vision_tower.encoder.weight"] = torch.zeros(2, 2)  # a tower's tensor: skipped
    save_file(tensors, mm / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (mm / name).write_bytes((text / name).read_bytes())
    ids = prompt(20, 3)
    models = [
        load_model(
            resolve_checkpoint(str(p)), dtype="float32", device="cpu", weights="float", max_positions=64
        )
        for p in (text, mm)
    ]
    assert models[1].cfg.model_type == f"{family}_text"
    assert torch.equal(prefill_logits(models[0], ids), prefill_logits(models[1], ids))


def test_a_cached_pool_smaller_than_the_prompt_gives_the_resident_output(tmp_path, caplog):
    path = make_tiny_ple_checkpoint(tmp_path / "m", "gemma3n")
    prompts = [prompt(60, 1), prompt(45, 2)]  # ~55 and ~43 distinct tokens, a pool of 16 rows
    batching = dict(enable_in_flight_batching=True, max_batch_size=2)
    with tiny_llm(path, **batching) as llm:
        resident = [llm.generate(p, GREEDY_64).token_ids for p in prompts]
        key = llm.bundle.key
    cached = {"residency": "cached", "cache_slots": 17}
    with caplog.at_level("INFO", logger="trtedge"), tiny_llm(path, ple_config=cached, **batching) as llm:
        got = in_threads(lambda p: llm.generate(p, GREEDY_64).token_ids, prompts)
        stats = llm.stats()["ple_cache"]
        assert llm.bundle.key == key  # where the rows live does not change the bundle
        assert llm.model.ple.pool.shape[0] == 17
        # the table is read by rows from the weights' own file, never loaded whole
        assert llm.model.ple.config.file_path.endswith(".safetensors")
    assert got == resident
    assert stats["residency"] == "cached" and stats["slots"] == 17
    assert stats["split_steps"] > 0 and stats["evictions"] > 0
    assert stats["misses"] >= len(set(prompts[0]) | set(prompts[1]))
    assert stats["hits"] > 0 and stats["bytes_loaded"] == stats["misses"] * 4 * 8 * 4  # rows of 4 x 8 floats
    assert 0 < stats["staging_bytes"] <= 64 * 2**20 and stats["rows_resident"] <= 16
    assert "per-layer embeddings: cached, 17 slots" in caplog.text and "of the 64 MiB budget" in caplog.text


def test_the_pool_splits_a_step_into_pieces_that_fit_and_keeps_each_sequence_causal():
    ids = [5, 6, 5, 7, 8, 9, 5, 10]
    assert plan_pieces(ids, None) == [(0, 8)]
    assert plan_pieces(ids, 3) == [(0, 4), (4, 7), (7, 8)]
    assert all(len(set(ids[a:b])) <= 3 for a, b in plan_pieces(ids, 3))
    batch = AttentionBatch(
        slot_mapping=torch.arange(8),
        query_lens=[5, 3],
        context_lens=[9, 3],  # the first sequence has 4 tokens in the cache already
        block_tables=[torch.tensor([0]), torch.tensor([1])],
        block_size=16,
    )
    piece = split_batch(batch, 4, 7)  # the first sequence's last token, the second's first two
    assert piece.query_lens == [1, 2] and piece.context_lens == [9, 2]
    assert piece.slot_mapping.tolist() == [4, 5, 6]
    masked = AttentionBatch(**{**batch.__dict__, "masks": [torch.ones(5, 9, dtype=torch.bool), None]})
    with pytest.raises(PleCapacityError, match="--ple-cache-slots"):
        split_batch(masked, 2, 7)  # a verified token tree cannot be cut


def test_a_step_that_cannot_fit_the_pool_is_refused_naming_the_flags(tmp_path):
    path = make_tiny_ple_checkpoint(tmp_path / "m", "gemma4")
    checkpoint = resolve_checkpoint(str(path))
    ple = PleRuntimeConfig(residency="cached", cache_slots=3)
    model = load_model(checkpoint, dtype="float32", device="cpu", weights="float", max_positions=64, ple=ple)
    ids = [11, 12, 13, 14]
    kv = torch.zeros(2, 2, 1, 16, 2, 32)
    batch = AttentionBatch(
        slot_mapping=torch.arange(4),
        query_lens=[4],
        context_lens=[4],
        block_tables=[torch.tensor([0])],
        block_size=16,
        masks=[torch.ones(4, 4, dtype=torch.bool).tril()],
    )
    with pytest.raises(PleCapacityError) as e:
        model.forward(torch.tensor(ids), torch.arange(4), [(kv[i, 0], kv[i, 1]) for i in range(2)], batch)
    message = str(e.value)
    assert "--ple-cache-slots" in message and "--ple-residency resident" in message
    assert model.ple.capacity == 2 and not model.graph_safe


def test_ple_settings_are_validated_naming_the_flag(tmp_path):
    for bad, flag in [
        ({"residency": "offload"}, "--ple-residency"),
        ({"residency": "cached"}, "--ple-cache-slots"),
        ({"residency": "cached", "cache_slots": 1}, "--ple-cache-slots"),
        ({"cache_slots": 8}, "--ple-residency cached"),
        ({"file_path": str(tmp_path / "none.safetensors")}, "--ple-file"),
        ({"slots": 4}, "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=flag):
            LLM(str(tmp_path), ple_config=bad)


def test_a_ple_file_replaces_the_checkpoint_table(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_ple_checkpoint(tmp_path / "m", "gemma4")
    tensors = load_file(path / "model.safetensors")
    table = tensors["model.embed_tokens_per_layer.weight"]
    save_file(
        {"model.embed_tokens_per_layer.weight": table.flip(0).contiguous()}, tmp_path / "ple.safetensors"
    )
    ids = prompt(20, 4)
    checkpoint = resolve_checkpoint(str(path))
    load = dict(dtype="float32", device="cpu", weights="float", max_positions=64)
    base = load_model(checkpoint, **load)
    from_file = load_model(
        checkpoint, **load, ple=PleRuntimeConfig(file_path=str(tmp_path / "ple.safetensors"))
    )
    assert not torch.equal(prefill_logits(base, ids), prefill_logits(from_file, ids))  # the file's rows
    flipped = [PLE_VOCAB - 1 - i for i in ids]
    assert torch.equal(from_file.ple.rows(torch.tensor(flipped)), base.ple.rows(torch.tensor(ids)))
    cached = PleRuntimeConfig(residency="cached", cache_slots=8, file_path=str(tmp_path / "ple.safetensors"))
    mapped = load_model(checkpoint, **load, ple=cached)
    # 20 tokens through 7 rows: run in pieces, equal up to the rounding of a split attention (torch's
    # flash kernel sums a masked piece's keys in other blocks than a causal whole: 1.3e-5 apart on
    # logits up to 3.7)
    assert torch.allclose(prefill_logits(mapped, ids), prefill_logits(from_file, ids), atol=5e-5)
    assert mapped.ple.split_steps == 1 and mapped.ple.host.data_ptr() != table.data_ptr()


def write_ple_gguf(hf_dir, path, arch: str) -> None:
    """A float32 GGUF of a tiny Gemma 3n / Gemma 4 in llama.cpp's layout: tensor names from gguf's own
    name map, Gemma 3n's AltUp projections stacked and its sparsity as Gaussian quantiles, Gemma 4's
    global head size as key_length and its unrotated pairs marked in rope_freqs."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.GEMMA3N if arch == "gemma3n" else gguf.MODEL_ARCH.GEMMA4, layers
    )
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    shared_from = layers - cfg["num_kv_shared_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(layers)
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    if cfg["final_logit_softcapping"]:
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_sliding_window_pattern(swa)
    writer.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
    writer.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    extra = {}
    if arch == "gemma3n":
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_altup_active_idx(cfg["altup_active_idx"])
        writer.add_altup_num_inputs(cfg["altup_num_inputs"])
        normal = torch.distributions.Normal(0.0, 1.0)
        scales = [normal.icdf(torch.tensor(s)).item() for s in cfg["activation_sparsity_pattern"]]
        writer.add_activation_sparsity_scale(scales)
    else:
        full_dim = cfg["per_layer_config"][str(swa.index(False))]["head_dim"]
        n_ff = cfg["intermediate_size"]
        wide = cfg["use_double_wide_mlp"]
        writer.add_feed_forward_length(
            [n_ff * 2 if wide and i >= shared_from else n_ff for i in range(layers)]
        )
        overrides = cfg["per_layer_config"]
        kv = cfg["num_key_value_heads"]
        writer.add_head_count_kv(
            [kv if s else overrides[str(i)].get("num_key_value_heads", kv) for i, s in enumerate(swa)]
        )
        writer.add_key_length(full_dim)
        writer.add_value_length(full_dim)
        writer.add_key_length_swa(cfg["head_dim"])
        writer.add_value_length_swa(cfg["head_dim"])
        writer.add_rope_dimension_count(full_dim)
        writer.add_rope_dimension_count_swa(cfg["head_dim"])
        rotated = int(full_dim * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
        factors = [1.0] * rotated + [1e30] * (full_dim // 2 - rotated)
        extra["rope_freqs.weight"] = np.array(factors, dtype=np.float32)
        if cfg["enable_moe_block"]:
            writer.add_expert_count(cfg["num_experts"])
            writer.add_expert_used_count(cfg["top_k_experts"])
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tokens = ["<pad>", "<bos>", "<eos>"] + [f"▁w{i}" for i in range(3, PLE_VOCAB)]
    writer.add_tokenizer_model("llama" if arch == "gemma3n" else "gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (PLE_VOCAB - 3))
    writer.add_token_scores([0.0] * PLE_VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    tensors = load_file(hf_dir / "model.safetensors")
    for stacked in ("altup_projections", "altup_unembed_projections"):
        if arch == "gemma3n":
            parts = [tensors.pop(f"model.{stacked}.{i}.weight") for i in range(cfg["altup_num_inputs"] - 1)]
            tensors[f"model.{stacked}.weight"] = torch.stack(parts)
    tensors.pop("lm_head.weight", None)  # tied to the embedding
    scales = {"router.scale": "ffn_gate_inp", "router.per_expert_scale": "ffn_down_exps"}  # the converter's
    for name, tensor in tensors.items():
        layer, _, part = name.removeprefix("model.layers.").partition(".")
        if part in scales:
            writer.add_tensor(f"blk.{layer}.{scales[part]}.scale", tensor.float().numpy())
            continue
        if name.endswith(("_scale", "layer_scalar", "_proj")):
            name += ".weight"  # as the converter names a bare parameter
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.float().numpy())
    for name, array in extra.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("gemma3n", {"altup_num_inputs": 4}),
        ("gemma4_k_eq_v", {}),
        ("gemma4_moe", {}),
    ],  # llama.cpp converts 4 AltUp streams only
)
def test_a_gguf_in_llama_cpp_s_layout_matches_transformers(family, overrides, tmp_path):
    hf_dir = make_tiny_ple_checkpoint(tmp_path / "hf", family, **overrides)
    arch = family.split("_")[0]
    path = tmp_path / f"{arch}.gguf"
    write_ple_gguf(hf_dir, path, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = prompt(40, 5)
    load = dict(dtype="float32", device="cpu", weights="float", max_positions=64)
    model = load_model(resolve_checkpoint(str(path)), **load)
    assert model.cfg.model_type == f"{arch}_text" and model.num_kv_layers == 2
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(model, ids) - ref).abs().max().item() < 1e-4
    with LLM(str(path), dtype="float32", device="cpu", max_kv_cache_capacity=128) as llm:
        out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).token_ids
    assert hf_greedy_choices(hf, ids, out) == out


def test_context_reuse_with_partial_blocks_matches_a_cold_run_when_layers_differ_in_kv_size(tmp_path):
    """Gemma 4's global layers have twice the sliding layers' KV row: each layer's blocks must sit where
    the runner's block copies (here: partial-block snapshots) put them."""
    from trtedge import ContextCacheConfig

    path = make_tiny_ple_checkpoint(tmp_path / "m", "gemma4")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = prompt(40, 6)  # two full blocks and 8 tokens
    with tiny_llm(path) as llm:
        cold = llm.generate(first + [11, 12, 13], greedy).token_ids
    reuse = ContextCacheConfig(enabled=True, partial_kv_snapshot_pool_bytes=1 << 20)
    with tiny_llm(path, context_cache_config=reuse) as llm:
        assert llm.model.layers[0].attn.head_dim * 2 == llm.model.layers[1].attn.head_dim
        llm.generate(first, greedy)
        llm.generate(prompt(60, 7), SamplingParams(max_tokens=2, temperature=0, reuse_context=False))
        warm = llm.generate(first + [11, 12, 13], greedy)
        partial = llm.get_context_cache_metrics().partial_kv_reused_tokens
    assert warm.metrics.reused_tokens == 40 and partial == 8
    assert warm.token_ids == cold


def test_random_dummy_weights_are_refused_naming_the_flag(tmp_path):
    path = make_tiny_ple_checkpoint(tmp_path / "m", "gemma4")
    with pytest.raises(ValueError, match="--load-format"):
        load_model(
            resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights="float", max_positions=64,
            load_format="dummy",
        )  # fmt: skip
