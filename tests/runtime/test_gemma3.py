"""Gemma 3: the packaged 270M GGUF (config read from the file, real text) and its HF equivalence."""

from __future__ import annotations

import pytest
import torch

from trtedge import LLM, SamplingParams


@pytest.fixture(scope="module")
def gemma(gemma3_gguf):
    llm = LLM(str(gemma3_gguf), max_kv_cache_capacity=1024, max_input_len=768)
    yield llm
    llm.close()


def test_gguf_config_has_gemma3_interleaved_layers(gemma):
    checkpoint = gemma.checkpoint
    config = checkpoint.config
    assert config["model_type"] == "gemma3_text"
    assert config["sliding_window"] == 512
    types = config["layer_types"]
    assert len(types) == 18 and [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17]
    assert config["hidden_activation"] == "gelu_pytorch_tanh" and config["query_pre_attn_scalar"] == 256
    assert gemma.tokenizer.eos_token_ids == {1, 106}  # <eos> and <end_of_turn> both end a reply
    windows = [layer.window for layer in gemma.model.layers]
    assert windows == [0 if t == "full_attention" else 512 for t in types]


def test_gemma3_270m_answers_simple_prompts(gemma):
    greedy = SamplingParams(max_tokens=16, temperature=0)
    answer = gemma.generate("Question: What is 2 + 3?\nAnswer:", greedy).text
    print(repr(answer))
    assert "5" in answer.split("\n")[0]
    colors = gemma.generate("The three primary colors are", greedy).text
    print(repr(colors))
    assert "red" in colors and "blue" in colors


def test_a_cached_launch_runs_the_bundle_weights_as_stored_converting_nothing(
    gemma, gemma3_gguf, monkeypatch
):
    """The bundle holds what the runtime runs: Q4_K / Q6_K / Q8_0 tensors as the file's blocks, Q5_0
    (and what it is fused with) as int8. A cached
    launch quantized every layer to int8 again (and dequantized the bundle first): ~10 s a launch."""
    from trtedge.runtime.artifacts import quantize
    from trtedge.runtime.ops import linear

    def refuse(*args, **kwargs):
        raise AssertionError("a cached launch converted weights")

    for module, name in [(quantize, "quantize"), (quantize, "quantize_int8"), (linear, "quantize_int8")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(linear, "quantize", refuse)
    monkeypatch.setattr(quantize.QuantizedTensor, "dequantize", refuse)
    with LLM(str(gemma3_gguf), max_kv_cache_capacity=1024, max_input_len=768) as llm:
        assert not llm.bundle.built
        sources = llm.checkpoint.quantization
        layer = llm.model.layers[0]
        assert sources["model.layers.0.self_attn.o_proj.weight"] == "Q4_K"
        assert type(layer.o).__name__ == "GgufLinear"
        assert type(layer.qkv).__name__ == type(layer.mlp.gate_up).__name__ == "Int8Linear"
        assert llm.model.embed.format == "gguf"  # the Q8_0 blocks, also the lm_head
        kinds = {type(m).__name__ for layer in llm.model.layers for m in layer.linears}
        assert kinds == {"GgufLinear", "Int8Linear"}


def test_gemma3_chat_template_renders_gemma_turns(gemma):
    ids = gemma.encode_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = gemma.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.chat_template_origin == "default"  # the file has none: a base model (chat warns)


@pytest.mark.slow
def test_gemma3_270m_prompt_longer_than_the_window_matches_transformers(gemma3_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.runtime.test_models import prefill_logits
    from tests.tiny import export_gguf_as_hf

    path = export_gguf_as_hf(gemma3_gguf, tmp_path / "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(
        str(path), dtype="float32", weights="float", max_kv_cache_capacity=1024, max_input_len=800
    ) as llm:
        ids = list(range(1000, 1700))  # 700 tokens, sliding window 512
        ours = prefill_logits(llm.model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"Gemma 3 270M, 700 tokens: max |logit difference| = {diff:.2e}")
    assert diff < 1e-3
