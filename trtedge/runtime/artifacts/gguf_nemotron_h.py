"""Nemotron-H GGUF files in llama.cpp's layout (architectures ``nemotron_h`` and ``nemotron_h_moe``):
names from gguf's tensor map, the converter's reshapes undone, and the layer types read back from the
per-layer arrays (a Mamba-2 layer has no KV heads and no feed-forward width, an attention layer has
KV heads, an MLP or MoE layer a feed-forward width)."""

from __future__ import annotations

import re

import torch

ARCHITECTURES = {
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
    "nemotron_h_moe": ("nemotron_h", "NemotronHForCausalLM"),
}

_GLOBAL = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}
_LAYER = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mixer.gate",
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj",
    "ffn_latent_up": "mixer.fc2_latent_proj",
}
# Stored without the HF suffix, or under another one.
_RENAMED = {
    ("ssm_a", None): "mixer.A_log",  # the converter stores A = -exp(A_log), [heads, 1]
    ("ssm_d", None): "mixer.D",  # [heads, 1]
    ("ssm_dt", "bias"): "mixer.dt_bias",
    ("exp_probs_b", "bias"): "mixer.gate.e_score_correction_bias",
    ("ffn_up_exps", "weight"): "mixer.experts.up_proj",  # [experts, intermediate, hidden]
    ("ffn_down_exps", "weight"): "mixer.experts.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(model, gguf_name: str) -> str | None:
    """HF name (NVIDIA's ``backbone.`` layout) of a GGUF tensor; None for the multi-token-prediction
    block the converter appends after the decoder's (skipped, as from a safetensors checkpoint)."""
    if (block := _BLOCK_RE.match(gguf_name)) and int(block.group(1)) >= num_layers(model):
        return None
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        prefix = f"backbone.layers.{layer}."
        if (part, kind) in _RENAMED:
            return prefix + _RENAMED[part, kind]
        if part in _LAYER and kind is not None:
            return f"{prefix}{_LAYER[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise model.error(f"unsupported tensor {gguf_name!r} for architecture {model.arch!r}")


def num_layers(model) -> int:
    """Decoder layers: the file's blocks less its trailing multi-token-prediction ones."""
    return int(model.require_hparam("block_count")) - int(model.hparam("nextn_predict_layers", 0) or 0)


def to_hf_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Undo convert_hf_to_gguf's reshapes: A back to A_log, D and the grouped norm flat, the conv
    weight [channels, 1, kernel]."""
    if name.endswith("mixer.A_log"):
        return (-tensor.float()).log().flatten()
    if name.endswith(("mixer.D", "mixer.norm.weight")):
        return tensor.flatten()
    if name.endswith("mixer.conv1d.weight"):
        return tensor.unsqueeze(1)
    return tensor


def layer_types(model) -> list[str]:
    n = num_layers(model)
    kv = _per_layer(model.hparam("attention.head_count_kv", 0), n)[:n]
    ff = _per_layer(model.hparam("feed_forward_length", 0), n)[:n]
    ffn = "moe" if model.arch == "nemotron_h_moe" else "mlp"
    return ["full_attention" if k else ffn if f else "linear_attention" for k, f in zip(kv, ff)]


def num_kv_heads(model) -> int:
    return max(_per_layer(model.hparam("attention.head_count_kv", 0), num_layers(model)))


def config_fields(model) -> dict:
    """The config.json fields of the Mamba-2 and MoE layers, as transformers' NemotronHConfig names them."""
    types = layer_types(model)
    heads = int(model.require_hparam("ssm.time_step_rank"))
    ff = _per_layer(model.hparam("feed_forward_length", 0), len(types))[: len(types)]
    fields = {
        "num_hidden_layers": len(types),
        "layers_block_type": types,
        "mamba_num_heads": heads,
        "mamba_head_dim": int(model.require_hparam("ssm.inner_size")) // heads,
        "ssm_state_size": int(model.require_hparam("ssm.state_size")),
        "n_groups": int(model.require_hparam("ssm.group_count")),
        "conv_kernel": int(model.require_hparam("ssm.conv_kernel")),
        "mlp_hidden_act": "relu2",  # llama.cpp's only activation for this family
        "intermediate_size": max(ff, default=0),
    }
    if model.arch == "nemotron_h_moe":
        fields.update(
            n_routed_experts=int(model.require_hparam("expert_count")),
            num_experts_per_tok=int(model.require_hparam("expert_used_count")),
            moe_intermediate_size=int(model.require_hparam("expert_feed_forward_length")),
            moe_shared_expert_intermediate_size=int(
                model.require_hparam("expert_shared_feed_forward_length")
            ),
            norm_topk_prob=bool(model.hparam("expert_weights_norm", True)),
            routed_scaling_factor=float(model.hparam("expert_weights_scale", 1.0)),
            n_group=int(model.hparam("expert_group_count", 1)),
            topk_group=int(model.hparam("expert_group_used_count", 1)),
            moe_latent_size=model.hparam("moe_latent_size"),
        )
    return fields


def _per_layer(value, num_layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * num_layers
