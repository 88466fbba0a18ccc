"""A randomly initialised EAGLE-3 head saved in the published checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_eagle3_head(
    directory: Path,
    target_hidden: int,
    vocab: int,
    draft_vocab: int = 256,
    aux_layers=(0, 1, 2),
    seed: int = 0,
) -> Path:
    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 128
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    # draft ids map to a sorted random subset of the target vocabulary: target = d + d2t[d]
    subset = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[subset] = True
    m = "midlayer."
    tensors = {
        "fc.weight": rand(hidden, 3 * target_hidden),
        f"{m}input_layernorm.weight": torch.ones(hidden),
        f"{m}hidden_norm.weight": torch.ones(hidden),
        f"{m}post_attention_layernorm.weight": torch.ones(hidden),
        f"{m}self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        f"{m}self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{m}self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{m}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{m}mlp.gate_proj.weight": rand(inter, hidden),
        f"{m}mlp.up_proj.weight": rand(inter, hidden),
        f"{m}mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": subset - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": target_hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
