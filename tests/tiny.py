"""Tiny random checkpoints built with transformers (the reference) for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512

FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama3": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    # Phi-3.5 style: fused qkv/gate_up, longrope (short factors within 256 positions), half the
    # head rotated, every layer sliding over 48 keys.
    "phi3": dict(
        model_type="phi3",
        pad_token_id=0,
        original_max_position_embeddings=256,
        max_position_embeddings=1024,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(4)],
            "long_factor": [2.0 + 0.5 * i for i in range(4)],
        },
        partial_rotary_factor=0.5,
        sliding_window=48,
    ),
    # Six experts, top-2 without renormalising; layer 1 dense (mlp_only_layers).
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # Shared expert behind a sigmoid gate, top-2 of 4 renormalised, q/k/v biases.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=48),
    # A sliding layer (16 keys, local rope base) then a global one (linear-scaled rope); final
    # logit soft-capping.
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=30.0,
    ),
}


def make_tiny_checkpoint(directory: Path, family: str, seed: int = 0) -> Path:
    """Save a random 2-layer model of ``family`` with a word-level tokenizer into ``directory``."""
    import transformers

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        **{"max_position_embeddings": 256, **spec},
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory)
    return directory


HYBRID_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_hybrid_checkpoint(
    directory: Path, vision: bool = True, seed: int = 0, moe: bool = False, family: str = "qwen3_5"
) -> Path:
    """A random 4-layer Qwen3.5 (linear, full, linear, full attention): the vision-language checkpoint
    (``qwen3_5``, with a one-block vision tower) or the text-only one (``qwen3_5_text``); with ``moe``
    the text-only Qwen3.5-MoE (``qwen3_5_moe_text``: 4 experts, top-2, a gated shared expert); with
    ``family="qwen3_next"`` a Qwen3-Next (fused projections; MoE but a dense layer 1)."""
    import transformers

    torch.manual_seed(seed)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **HYBRID_TEXT, **experts, shared_expert_intermediate_size=48, mlp_only_layers=[1]
        )
        model = transformers.Qwen3NextForCausalLM(config)
    elif moe:
        config = transformers.Qwen3_5MoeTextConfig(
            **HYBRID_TEXT, **experts, shared_expert_intermediate_size=48
        )
        model = transformers.Qwen3_5MoeForCausalLM(config)
    elif vision:
        vision_config = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            temporal_patch_size=2,
            num_position_embeddings=16,
        )
        config = transformers.Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=vision_config)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID_TEXT))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # random, not identity, so that a wrong formula shows
                p.normal_(1.0 if "linear_attn" in name else 0.0, 0.2)
            elif name.endswith("A_log"):  # slow decay: the state remembers tens of tokens, not a few
                p.uniform_(0.005, 0.05).log_()
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory)
    return directory


def write_word_tokenizer(directory: Path, size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2", "chat_template": template})
    )


def export_gguf_as_hf(gguf_path: Path, directory: Path) -> Path:
    """Write a GGUF checkpoint as a float32 HF directory (the reference side of comparisons)."""
    from safetensors.torch import save_file

    from trtedge.runtime.artifacts.gguf import iter_gguf_tensors, read_gguf

    contents = read_gguf(gguf_path)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(contents.config, torch_dtype="float32")
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(contents.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(contents.tokenizer_config))
    (directory / "generation_config.json").write_text(json.dumps(contents.generation_config))
    tensors = {name: t.contiguous() for name, t in iter_gguf_tensors(gguf_path)}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, directory / "model.safetensors")
    return directory


# Gemma 3n / Gemma 4 text (per-layer embeddings): 4 layers, the last 2 sharing the KV of the first
# two (one sliding over 8 keys, one global); Gemma 4's global layers with their own head size.
PLE_FAMILIES = {
    "gemma3n": dict(
        model_type="gemma3n_text",
        laurel_rank=8,
        altup_num_inputs=3,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        final_logit_softcapping=30.0,
    ),
    "gemma4": dict(model_type="gemma4_text", global_head_dim=32),
    # keys as values and 1 KV head on the global layers, a double-wide MLP on the sharing layers
    "gemma4_k_eq_v": dict(
        model_type="gemma4_text",
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        use_double_wide_mlp=True,
        final_logit_softcapping=20.0,
    ),
    # the 26B-A4B shape: top-2 of 4 experts beside every layer's dense MLP
    "gemma4_moe": dict(
        model_type="gemma4_text",
        global_head_dim=32,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}
PLE_VOCAB = 1000


def make_tiny_ple_checkpoint(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Save a random 4-layer Gemma 3n / Gemma 4 text model; every vector (norms, layer scalars, AltUp
    scales) is randomised too, so that a misplaced one shows."""
    import transformers

    spec = {**PLE_FAMILIES[family], **overrides}
    model_type = spec.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(
        vocab_size=PLE_VOCAB,
        vocab_size_per_layer_input=PLE_VOCAB,
        hidden_size=64,
        hidden_size_per_layer_input=8,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        num_kv_shared_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, PLE_VOCAB)
    return directory


def make_tiny_hybrid_family(directory: Path, family: str) -> Path:
    """The tiny checkpoint of a hybrid ``family``: "qwen3_5" (text only) or "nemotron_h"."""
    if family == "nemotron_h":
        return make_tiny_nemotron_h_checkpoint(directory)
    return make_tiny_hybrid_checkpoint(directory, vision=False, family=family)


def make_tiny_nemotron_h_checkpoint(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random 4-layer Nemotron-H with every layer type (Mamba-2, MoE, attention, MLP): hidden 64, a
    16-token scan chunk (prompts longer than it run several chunks), 2 Mamba groups of 4 heads, 4
    routed experts (top-2 in 2 groups, sigmoid router with a correction bias) beside a shared one.
    ``overrides``: NemotronHConfig fields (``moe_latent_size``, ``layers_block_type``, ...)."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=2.5,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    config = transformers.NemotronHConfig(**{**fields, **overrides})
    model = transformers.NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".D"):  # random, so that a wrong formula shows
                p.normal_(1.0, 0.2)
            elif name.endswith("A_log"):  # slow decay: the state remembers tens of tokens, not a few
                p.uniform_(0.05, 0.5).log_()
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("conv1d.bias"):
                p.normal_(0.0, 0.1)
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory)
    return directory
