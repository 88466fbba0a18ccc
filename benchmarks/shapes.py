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
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = qwen3_config(name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w151645"}))
    return directory
