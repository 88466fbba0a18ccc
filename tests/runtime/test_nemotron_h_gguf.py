"""Nemotron-H GGUF files (llama.cpp's layout: ``nemotron_h`` and ``nemotron_h_moe``) written here from
tiny HF checkpoints the way convert_hf_to_gguf.py writes them, with gguf's own tensor-name map: the
tensors read back equal the checkpoint's, and served from the GGUF the model matches HF greedy."""

from __future__ import annotations

import gguf
import pytest
import torch
from safetensors.torch import load_file

from tests.runtime.test_gguf_loader import MERGES, VOCAB, tiny_vocab
from tests.tiny import make_tiny_nemotron_h_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.artifacts.gguf import GGUFError, iter_gguf_tensors, read_gguf

transformers = pytest.importorskip("transformers")

LAYOUTS = {
    "nemotron_h": ["linear_attention", "mlp", "full_attention", "linear_attention"],
    "nemotron_h_moe": ["linear_attention", "moe", "full_attention", "moe"],
}


def special_id(token: str) -> int:
    return tiny_vocab()[0].index(token)


def llama_cpp_tensors(weights: dict[str, torch.Tensor], arch: str, n_groups: int, num_layers: int):
    """convert_hf_to_gguf.py's output for Nemotron-H: A stored as -exp(A_log) [heads, 1], D [heads, 1],
    the gated norm as [groups, inner / groups], the conv weight squeezed to [channels, kernel],
    dt_bias as ssm_dt.bias, the router bias as exp_probs_b.bias, experts stacked per layer."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    out, experts = {}, {}
    for name, t in weights.items():
        stem = name.removeprefix("backbone.layers.")
        layer, _, rest = stem.partition(".")
        if rest.startswith("mixer.experts."):  # mixer.experts.<e>.up_proj.weight
            e, proj = rest.split(".")[2:4]
            experts.setdefault((layer, proj), {})[int(e)] = t
            continue
        if rest == "mixer.A_log":
            out[f"blk.{layer}.ssm_a"] = -t.exp().reshape(-1, 1)
        elif rest == "mixer.D":
            out[f"blk.{layer}.ssm_d"] = t.reshape(-1, 1)
        elif rest == "mixer.dt_bias":
            out[f"blk.{layer}.ssm_dt.bias"] = t
        elif rest == "mixer.gate.e_score_correction_bias":
            out[
                names.get_name(
                    f"backbone.layers.{layer}.mixer.gate.e_score_correction.bias", try_suffixes=(".bias",)
                )
            ] = t
        elif rest == "mixer.norm.weight":
            out[f"blk.{layer}.ssm_norm.weight"] = t.reshape(n_groups, -1)
        elif rest == "mixer.conv1d.weight":
            out[f"blk.{layer}.ssm_conv1d.weight"] = t.squeeze(1)
        else:
            out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    for (layer, proj), parts in experts.items():
        merged = f"model.layers.{layer}.mlp.experts.{proj}.weight"
        out[names.get_name(merged, try_suffixes=(".weight",))] = torch.stack(
            [parts[e] for e in sorted(parts)]
        )
    assert None not in out
    return out


def write_nemotron_h_gguf(path, checkpoint, arch: str, mtp: bool = False) -> None:
    """``mtp``: with a multi-token-prediction block after the decoder's, as the converter folds it."""
    cfg = transformers.AutoConfig.from_pretrained(checkpoint)
    types = cfg.layers_block_type
    writer = gguf.GGUFWriter(str(path), arch)
    if mtp:
        types = [*types, "full_attention"]  # attention and MoE in one block: KV heads and a width
        writer.add_nextn_predict_layers(1)
    writer.add_block_count(len(types))
    writer.add_context_length(1024)
    writer.add_embedding_length(cfg.hidden_size)
    ffn = cfg.moe_intermediate_size if arch == "nemotron_h_moe" else cfg.intermediate_size
    writer.add_feed_forward_length([ffn if t in ("mlp", "moe") or i == 4 else 0 for i, t in enumerate(types)])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in types])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    writer.add_ssm_conv_kernel(cfg.conv_kernel)
    writer.add_ssm_state_size(cfg.ssm_state_size)
    writer.add_ssm_group_count(cfg.n_groups)
    writer.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    writer.add_ssm_time_step_rank(cfg.mamba_num_heads)
    if arch == "nemotron_h_moe":
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_group_count(cfg.n_group)
    writer.add_vocab_size(cfg.vocab_size)
    tokens, token_types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(special_id("<|im_start|>"))
    writer.add_eos_token_id(special_id("<|im_end|>"))
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    weights = load_file(checkpoint / "model.safetensors")
    tensors = llama_cpp_tensors(weights, arch, cfg.n_groups, len(types))
    if mtp:
        tensors |= {f"blk.4.{n}.weight": torch.ones(cfg.hidden_size) for n in ("nextn.enorm", "nextn.hnorm")}
        tensors["blk.4.attn_q.weight"] = torch.ones(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loader yields experts fused ([experts, rows, columns]), as transformers 5 holds them."""
    out, experts = {}, {}
    for name, t in weights.items():
        parts = name.split(".")  # backbone.layers.<l>.mixer.experts.<e>.<proj>.weight
        if ".mixer.experts." in name:
            experts.setdefault(".".join(parts[:5] + parts[6:7]), {})[int(parts[5])] = t
        else:
            out[name] = t
    return out | {name: torch.stack([v[e] for e in sorted(v)]) for name, v in experts.items()}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def converted(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    checkpoint = make_tiny_nemotron_h_checkpoint(
        root / "hf",
        vocab_size=VOCAB,
        layers_block_type=LAYOUTS[arch],
        bos_token_id=special_id("<|im_start|>"),
        eos_token_id=special_id("<|im_end|>"),
    )
    path = root / f"{arch}.gguf"
    write_nemotron_h_gguf(path, checkpoint, arch)
    return arch, checkpoint, path


def test_tensors_and_config_read_back_as_the_checkpoint_holds_them(converted):
    arch, checkpoint, path = converted
    weights = fused_experts(load_file(checkpoint / "model.safetensors"))
    got = dict(iter_gguf_tensors(path))
    assert sorted(got) == sorted(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    cfg = read_gguf(path).config
    assert cfg["model_type"] == "nemotron_h" and cfg["layers_block_type"] == LAYOUTS[arch]
    assert (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]) == (
        4,
        16,
        8,
        2,
    )
    assert cfg["num_key_value_heads"] == 2 and cfg["mlp_hidden_act"] == "relu2"


def test_served_from_the_gguf_greedy_matches_transformers(converted):
    arch, checkpoint, path = converted
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="float32", max_kv_cache_capacity=256, max_input_len=128) as llm:
        out = llm.generate(ids, params).token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out])).logits[0]
    assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out


def test_an_unknown_tensor_is_refused_with_its_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "nemotron_h")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ssm_mystery.weight", torch.ones(2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="unsupported tensor 'blk.0.ssm_mystery.weight'"):
        list(iter_gguf_tensors(tmp_path / "x.gguf"))


def test_a_folded_multi_token_prediction_block_is_skipped(converted, tmp_path):
    arch, checkpoint, path = converted
    with_mtp = tmp_path / "mtp.gguf"
    write_nemotron_h_gguf(with_mtp, checkpoint, arch, mtp=True)
    cfg = read_gguf(with_mtp).config
    assert cfg["num_hidden_layers"] == 4 and cfg["layers_block_type"] == LAYOUTS[arch]
    assert [n for n, _ in iter_gguf_tensors(with_mtp)] == [n for n, _ in iter_gguf_tensors(path)]
