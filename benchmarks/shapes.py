"""Model shapes for benchmarks: config.json + a word-level tokenizer, no weights
(run with ``load_format="dummy"``)."""

from __future__ import annotations

import json
from pathlib import Path

QWEN3 = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}


# Llama geometries (the gpt-fast comparisons): Llama-3.2-1B and Llama-3-8B, without rope scaling.
LLAMA = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


# Qwen3-30B-A3B: 128 experts, 8 active per token.
QWEN3_MOE = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}


def shape_config(name: str) -> dict:
    """The HF config of a benchmark shape (``QWEN3``, ``QWEN3_MOE`` or ``LLAMA`` names)."""
    if name in QWEN3_MOE:
        config = dict(
            qwen3_config("qwen3-0.6b"), model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]
        )
        return {**config, **QWEN3_MOE[name]}
    if name in LLAMA:
        return dict(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            torch_dtype="bfloat16",
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            bos_token_id=128000,
            eos_token_id=128001,
            **LLAMA[name],
        )
    if name not in QWEN3:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join([*QWEN3, *QWEN3_MOE, *LLAMA])}")
    return qwen3_config(name)


def qwen3_config(name: str) -> dict:
    return dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        torch_dtype="bfloat16",
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        **QWEN3[name],
    )


def write_shape(directory: Path, name: str) -> Path:
    return write_config_shape(directory, shape_config(name))


def write_config_shape(directory: Path, config: dict) -> Path:
    """``config`` and a word-level tokenizer of its vocabulary (``w0`` ... ``wN``) in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{config['eos_token_id']}"}))
    return directory


def write_agreeing_weights(directory: Path, name: str, scale: float = 0.1, keep: int = 2) -> Path:
    """Real safetensors for shape ``name`` in ``directory`` (already holding its config): the dummy
    weights ``load_format="dummy"`` draws (one seed, checkpoint order, on CUDA when present), with
    the output projections (o_proj, down_proj) of every layer past the first ``keep`` scaled by
    ``scale``. A ``keep``-layer dummy draft of the same width then holds exactly this target's
    embeddings, first layers and head, and the later layers only nudge the residual stream: the draft
    agrees with the target about as often as a trained draft does, while every step still reads the
    whole shape's bytes."""
    import torch
    from safetensors.torch import save_file

    from trtedge.runtime.artifacts.checkpoint import config_only_checkpoint
    from trtedge.runtime.models import dummy_tensors

    cfg = config_only_checkpoint(directory).model_config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tensors = {}
    for tensor_name, tensor in dummy_tensors(cfg, torch.bfloat16, device):
        layer = tensor_name.split(".")[2] if tensor_name.startswith("model.layers.") else None
        if (
            layer is not None
            and int(layer) >= keep
            and tensor_name.endswith(("o_proj.weight", "down_proj.weight"))
        ):
            tensor = tensor * scale
        tensors[tensor_name] = tensor.cpu().contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def qwen3_5_config(num_layers: int = 24, mtp: bool = True) -> dict:
    """A Qwen3.5-0.8B-style text config (Gated DeltaNet x 3, then full attention, repeating), with one
    MTP layer declared (``load_format="dummy"`` draws its weights too)."""
    return dict(
        model_type="qwen3_5_text",
        architectures=["Qwen3_5ForCausalLM"],
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        hidden_act="silu",
        torch_dtype="bfloat16",
        bos_token_id=248044,
        eos_token_id=248044,
        **({"mtp_num_hidden_layers": 1} if mtp else {}),
    )
