"""The torch.compile peer of benchmarks/gpu_decode.py is a correct decoder: its greedy tokens equal
HF transformers' with the same weights (eager, on the CPU, tiny Llama and Qwen3 configs)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import compiled_peer
from benchmarks.shapes import shape_config

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _hf_state(model: compiled_peer.Transformer) -> dict[str, torch.Tensor]:
    state = {
        "model.embed_tokens.weight": model.embed.weight,
        "lm_head.weight": model.output.weight,
        "model.norm.weight": model.norm.weight,
    }
    for i, layer in enumerate(model.layers):
        a, p = layer.attention, f"model.layers.{i}."
        q, k, v = a.wqkv.weight.split([a.q_size, a.kv_size, a.kv_size])
        gate, up = layer.w_gate_up.weight.chunk(2)
        state |= {
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": a.wo.weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.w_down.weight,
            p + "input_layernorm.weight": layer.attention_norm.weight,
            p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
        }
        if a.q_norm is not None:
            state[p + "self_attn.q_norm.weight"] = a.q_norm.weight
            state[p + "self_attn.k_norm.weight"] = a.k_norm.weight
    return {k: v.detach() for k, v in state.items()}


@pytest.mark.parametrize("family", ["llama-1b", "qwen3-0.6b"])
def test_peer_greedy_tokens_equal_transformers(family):
    import transformers

    config = {**shape_config(family), **TINY}
    model = compiled_peer.build(config, max_seq=64, device="cpu", dtype=torch.float32)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    missing = hf.load_state_dict(_hf_state(model), strict=False).missing_keys
    assert missing == []
    hf.generation_config.eos_token_id = None
    prompt = [5, 7, 9, 11, 13]
    tokens, _ = compiled_peer.generate(model, compiled_peer.decode_one, prompt, 12)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert tokens == ref[0, len(prompt) :].tolist()
    assert len(set(tokens)) > 1  # random weights, not a constant stream
