"""Read a llama.cpp GGUF file as the pieces of a Hugging Face checkpoint directory.

`read_gguf` gives config.json, tokenizer.json, tokenizer_config.json and generation_config.json
equivalents; `iter_gguf_tensors` streams the weights, dequantized, under HF names and layouts.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from trtedge.runtime.artifacts import gguf_nemotron_h as nemotron_h
from trtedge.runtime.artifacts.quantize import GGUF_KEPT
from trtedge.runtime.text.byte_level import BYTE_CHARS

log = logging.getLogger(__name__)

# GGUF architecture -> (HF model_type, HF architecture class)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "gemma3n": ("gemma3n_text", "Gemma3nForCausalLM"),
    "gemma4": ("gemma4_text", "Gemma4ForCausalLM"),
    **nemotron_h.ARCHITECTURES,
}
_PLE_ARCHITECTURES = {"gemma3n", "gemma4"}  # per-layer embeddings: norms stored as they are
# llama.cpp's converter permutes q/k rows for these (GGML "normal" rope); qwen2/qwen3 use NEOX rope, unpermuted.
_PERMUTED_ARCHITECTURES = {"llama", "mistral"}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its sandwich norms differently; llama.cpp stores its (1 + w) norm weights with the 1 added.
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 3n (llama.cpp's layout): its norms are stored as they are (no 1 added), the AltUp projections
# of the model stacked into one [streams - 1, hidden, hidden] tensor each.
_GEMMA3N_LAYER_TENSORS = {
    **_GEMMA3_LAYER_TENSORS,
    "altup_correct_scale": "altup.correct_output_scale",
    "altup_correct_coef": "altup.correction_coefs",
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GEMMA3N_GLOBAL_TENSORS = {
    **_GLOBAL_TENSORS,
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
    "altup_proj": "model.altup_projections",
    "altup_unembd_proj": "model.altup_unembed_projections",
}
# Gemma 4: the PLE tensors of Gemma 3n (no AltUp, no LAuReL) and a learned scalar per layer.
_GEMMA4_LAYER_TENSORS = {
    **_GEMMA3_LAYER_TENSORS,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
    # mixture of experts (26B-A4B): the router and the fused experts, beside the dense MLP
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# Gemma 4's router scales, stored by the converter as ".scale" of the router and the experts' down
_GEMMA4_SCALES = {"ffn_gate_inp": "router.scale", "ffn_down_exps": "router.per_expert_scale"}
_STACKED = {"model.altup_projections.weight", "model.altup_unembed_projections.weight"}
# HF parameters without ".weight"
_UNSUFFIXED = {"altup.correct_output_scale", "layer_scalar", "experts.gate_up_proj", "experts.down_proj"}
_IGNORED_TENSORS = {"rope_freqs.weight"}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)")
_GLOBAL_TENSOR_RE = re.compile(r"(\w+)\.(weight|bias)")

_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# For files that carry no tokenizer.chat_template: the family's own turn format.
_GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = '' %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] %}"
    "{% set system = (first if first is string else first | map(attribute='text') | join('\\n')) + '\\n\\n' %}"
    "{% set messages = messages[1:] %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% set content = message['content'] %}"
    "{% set text = content if content is string else content | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "<start_of_turn>{{ role }}\n{{ system if loop.first else '' }}{{ text | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_DEFAULT_CHAT_TEMPLATES = {"gemma3": _GEMMA3_CHAT_TEMPLATE, "gemma3n": _GEMMA3_CHAT_TEMPLATE}


def is_default_chat_template(template: str | None) -> bool:
    """Whether ``template`` is the stand-in given to a file that carries none (often a base model)."""
    return template is not None and template in _DEFAULT_CHAT_TEMPLATES.values()


# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as in the models' own tokenizer.json files.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_SPLIT_PRE = {
    **dict.fromkeys(_LLAMA3_PRE, _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# GPT-2 regex after splitting off every digit (StarCoder-style vocabularies such as SmolLM's).
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRE = {None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}


class GGUFError(ValueError):
    """A GGUF file that cannot be read or is not supported."""


@dataclass(frozen=True)
class GGUFContents:
    config: dict
    tokenizer_json: str
    tokenizer_config: dict
    generation_config: dict
    quantization: dict


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap (numpy.memmap slicing makes parsing ~4x slower)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)


class _GGUF:
    """An open GGUF file: its metadata by key and its tensors by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self.reader = _Reader(self.path)
        except Exception as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({_one_line(e)})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: unsupported architecture {self.arch!r} "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )

    def error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else _field_value(field)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise self.error(f"missing metadata key {key!r}")
        return value

    def hparam(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require_hparam(self, key: str) -> Any:
        return self.require(f"{self.arch}.{key}")

    def head_counts(self) -> tuple[int, int]:
        n_head = _uniform(self, "attention.head_count", self.require_hparam("attention.head_count"))
        kv = self.hparam("attention.head_count_kv", n_head)
        if self.arch == "gemma4" and isinstance(kv, list):  # per layer: sliding and global layers differ
            return n_head, int(kv[0])
        if self.arch in nemotron_h.ARCHITECTURES:  # per layer: 0 for the Mamba-2, MLP and MoE layers
            return n_head, nemotron_h.num_kv_heads(self)
        return n_head, _uniform(self, "attention.head_count_kv", kv)


def read_gguf(path: str | Path) -> GGUFContents:
    """Config, tokenizer and quantization summary of a GGUF file, as an HF checkpoint directory holds them."""
    model = _GGUF(path)
    names = {t.name: _hf_tensor_name(model, t.name) for t in model.reader.tensors}
    tokens = model.require("tokenizer.ggml.tokens")
    tokenizer, tokenizer_config = _build_tokenizer(model, tokens)
    config = _build_config(model, names, tokens)
    return GGUFContents(
        config=config,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tokenizer_config,
        generation_config=_generation_config(model),
        quantization=_quantization(model, names),
    )


def iter_gguf_tensors(
    path: str | Path, dtype: torch.dtype = torch.float32, keep_int4: bool = False, keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, dequantized tensor in HF layout) for each weight, in file order. With keep_int4,
    Q4_0/Q4_1 weights come as int4 ``QuantizedTensor``s (the same values, not dequantized); with
    keep_blocks, Q8_0 / Q4_K / Q5_K / Q6_K ones as "gguf" tensors of the file's own blocks."""
    model = _GGUF(path)
    names = {t.name: _hf_tensor_name(model, t.name) for t in model.reader.tensors}
    return _iter_tensors(model, names, dtype, keep_int4, keep_blocks)


def _iter_tensors(
    model: _GGUF,
    names: dict[str, str | None],
    dtype: torch.dtype,
    keep_int4: bool = False,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    n_head, n_head_kv = model.head_counts()
    permuted = model.arch in _PERMUTED_ARCHITECTURES
    norm_shift = 1.0 if model.arch == "gemma3" else 0.0
    for t in model.reader.tensors:
        name = names[t.name]
        if name is None:
            continue
        if keep_int4 and t.tensor_type in (QType.Q4_0, QType.Q4_1) and len(t.shape) == 2:
            yield name, _int4_tensor(t, name, n_head if ".q_proj." in name else n_head_kv, permuted)
            continue
        if (
            keep_blocks
            and t.tensor_type.name in GGUF_KEPT
            and len(t.shape) == 2
            and _plain_layout(model, name)
        ):
            yield name, _kept_blocks(t, name, n_head if ".q_proj." in name else n_head_kv, permuted)
            continue
        tensor = _dequantize(model, t)
        if name in _STACKED:  # one HF tensor per stream past the first
            for i, part in enumerate(tensor.unbind(0)):
                yield name.replace(".weight", f".{i}.weight"), part.to(dtype)
            continue
        if norm_shift and name.endswith("norm.weight"):
            tensor = tensor - norm_shift
        if model.arch in nemotron_h.ARCHITECTURES:
            tensor = nemotron_h.to_hf_layout(name, tensor)
        if permuted and ".self_attn.q_proj." in name:
            tensor = _unpermute_rows(tensor, n_head)
        elif permuted and ".self_attn.k_proj." in name:
            tensor = _unpermute_rows(tensor, n_head_kv)
        yield name, tensor.to(dtype)


def _hf_tensor_name(model: _GGUF, gguf_name: str) -> str | None:
    """HF name of a GGUF tensor, None for tensors HF does not store (rope_freqs)."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    if model.arch in nemotron_h.ARCHITECTURES:
        return nemotron_h.hf_tensor_name(model, gguf_name)
    if m := _LAYER_TENSOR_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        names = {
            "gemma3": _GEMMA3_LAYER_TENSORS,
            "gemma3n": _GEMMA3N_LAYER_TENSORS,
            "gemma4": _GEMMA4_LAYER_TENSORS,
        }.get(model.arch, _LAYER_TENSORS)
        if kind == "scale":
            if model.arch == "gemma4" and part in _GEMMA4_SCALES:
                return f"model.layers.{layer}.{_GEMMA4_SCALES[part]}"
        elif part in names:
            if names[part] in _UNSUFFIXED:
                return f"model.layers.{layer}.{names[part]}"
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif (m := _GLOBAL_TENSOR_RE.fullmatch(gguf_name)) and m.group(1) in (
        globals_ := _GEMMA3N_GLOBAL_TENSORS if model.arch in _PLE_ARCHITECTURES else _GLOBAL_TENSORS
    ):
        return f"{globals_[m.group(1)]}.{m.group(2)}"
    raise model.error(f"unsupported tensor {gguf_name!r} for architecture {model.arch!r}")


def _dequantize(model: _GGUF, t: gguf.ReaderTensor) -> torch.Tensor:
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (QType.F32, QType.F16):
        return torch.from_numpy(np.array(t.data)).reshape(shape)
    if t.tensor_type == QType.BF16:
        return torch.from_numpy(np.array(t.data)).view(torch.bfloat16).reshape(shape)
    try:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise model.error(
            f"tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized"
        ) from None
    return torch.from_numpy(data).reshape(shape)


def _int4_tensor(t: gguf.ReaderTensor, name: str, n_head: int, permuted: bool):
    from trtedge.runtime.artifacts.quantize import int4_from_gguf_blocks

    cols, rows = (int(n) for n in t.shape)
    q = int4_from_gguf_blocks(np.asarray(t.data), t.tensor_type.name, rows, cols)
    if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
        q = q.select_rows(_unpermute_rows(torch.arange(rows), n_head))
    return q


def _plain_layout(model: _GGUF, name: str) -> bool:
    """Whether the HF tensor is the GGUF one's rows (at most permuted), so its blocks can be kept."""
    return name not in _STACKED and model.arch not in nemotron_h.ARCHITECTURES


def _kept_blocks(t: gguf.ReaderTensor, name: str, n_head: int, permuted: bool):
    from trtedge.runtime.artifacts.quantize import gguf_blocks

    cols, rows = (int(n) for n in t.shape)
    q = gguf_blocks(np.asarray(t.data), t.tensor_type.name, rows, cols)
    if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
        q = q.select_rows(_unpermute_rows(torch.arange(rows), n_head))
    return q


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)`: GGML rope pairs -> HF rotate_half."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _build_config(model: _GGUF, names: dict[str, str | None], tokens: list[str]) -> dict:
    model_type, architecture = SUPPORTED_ARCHITECTURES[model.arch]
    hidden = model.require_hparam("embedding_length")
    n_head, n_head_kv = model.head_counts()
    head_dim = model.hparam("attention.key_length", hidden // n_head)
    rope_dim = model.hparam("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise model.error(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    rope_theta = float(model.hparam("rope.freq_base", 10000.0))
    bias = "blk.0.attn_q.bias" in model.tensors
    config = {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": hidden,
        "intermediate_size": _uniform(
            model, "feed_forward_length", model.require_hparam("feed_forward_length")
        )
        if model_type not in ("gemma3n_text", "gemma4_text", "nemotron_h")
        else model.require_hparam("feed_forward_length"),  # per layer (Nemotron-H: replaced below)
        "num_hidden_layers": model.require_hparam("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.require_hparam("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        # Gemma 4's rope_freqs marks the global layers' unrotated pairs (see _gemma4_config)
        "rope_scaling": _rope_scaling(model, rope_theta, head_dim) if model.arch != "gemma4" else None,
        "max_position_embeddings": model.require_hparam("context_length"),
        "vocab_size": _vocab_size(model, tokens),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "bos_token_id": model.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": model.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": bias,
        "torch_dtype": _torch_dtype(model, names),
    }
    if model_type in ("llama", "mistral"):
        config["mlp_bias"] = "blk.0.ffn_up.bias" in model.tensors
    if model_type != "llama":
        config["sliding_window"] = model.hparam("attention.sliding_window")
    if model_type == "gemma3_text":
        config.update(_gemma3_config(model, hidden, n_head, head_dim))
    if model_type == "gemma3n_text":
        config.update(_gemma3n_config(model, rope_theta))
    if model_type == "gemma4_text":
        config.update(_gemma4_config(model, rope_theta))
    if model_type == "nemotron_h":
        config.update(nemotron_h.config_fields(model), layer_norm_epsilon=config["rms_norm_eps"])
    return config


def _gemma4_config(model: _GGUF, rope_theta: float) -> dict:
    """Gemma 4's fields as llama.cpp's converter stores them: the global layers' head size as key_length
    (the sliding ones' as key_length_swa), KV heads per layer, and a rope_freqs tensor whose huge
    factors mark the pairs the global layers do not rotate."""
    layers = model.require_hparam("block_count")
    swa = model.hparam("attention.sliding_window_pattern")
    if swa is None:
        swa = [(i + 1) % 6 != 0 for i in range(layers)]
    full_dim = model.require_hparam("attention.key_length")
    kv = model.hparam("attention.head_count_kv", model.require_hparam("attention.head_count"))
    kv = kv if isinstance(kv, list) else [kv] * layers
    shared = model.hparam("attention.shared_kv_layers", 0)
    freqs = model.tensors.get("rope_freqs.weight")
    rotated = full_dim // 2 if freqs is None else int((_dequantize(model, freqs) < 1e10).sum())
    full = [i for i, s in enumerate(swa) if not s]
    ple = model.hparam("embedding_length_per_layer_input", 0)
    table = model.tensors.get("per_layer_token_embd.weight")
    return {
        "head_dim": model.hparam("attention.key_length_swa", full_dim),
        "num_key_value_heads": next((int(k) for k, s in zip(kv, swa) if s), int(kv[0])),
        "per_layer_config": {str(i): {"head_dim": full_dim, "num_key_value_heads": int(kv[i])} for i in full},
        # a global layer that computes its own KV but stores no value projection uses keys as values
        "attention_k_eq_v": any(
            f"blk.{i}.attn_v.weight" not in model.tensors for i in full if i < layers - shared
        ),
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 2 * rotated / full_dim,
                "rope_theta": rope_theta,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(model.hparam("rope.freq_base_swa", 10000.0)),
            },
        },
        "final_logit_softcapping": model.hparam("final_logit_softcapping"),
        "hidden_size_per_layer_input": ple,
        "vocab_size_per_layer_input": int(table.shape[-1]) if ple and table is not None else None,
        "num_kv_shared_layers": shared,
        **_gemma4_experts(model),
    }


def _gemma4_experts(model: _GGUF) -> dict:
    experts = model.tensors.get("blk.0.ffn_down_exps.weight")
    if experts is None:
        return {}
    return {
        "enable_moe_block": True,
        "num_experts": model.hparam("expert_count", int(experts.shape[-1])),
        "top_k_experts": model.require_hparam("expert_used_count"),
        "moe_intermediate_size": model.hparam("expert_feed_forward_length", int(experts.shape[0])),
    }


def _gemma3n_config(model: _GGUF, rope_theta: float) -> dict:
    """Gemma 3n's fields as llama.cpp's converter stores them (or derived from tensor shapes)."""
    layers = model.require_hparam("block_count")
    swa = model.hparam("attention.sliding_window_pattern")
    if swa is None:
        swa = [(i + 1) % 5 != 0 for i in range(layers)]
    table = model.tensors.get("per_layer_token_embd.weight")
    laurel = model.tensors.get("blk.0.laurel_l.weight")
    if table is None or laurel is None:
        raise model.error("a gemma3n file needs per_layer_token_embd and laurel_l tensors")
    # the converter stores each layer's Gaussian quantile of its activation sparsity, Phi^-1(s)
    scales = model.hparam("activation_sparsity_scale") or [-math.inf] * layers
    sparsity = [round(0.5 * (1 + math.erf(x / math.sqrt(2))), 6) for x in scales]
    feed_forward = model.require_hparam("feed_forward_length")
    return {
        "intermediate_size": feed_forward if isinstance(feed_forward, list) else [feed_forward] * layers,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": rope_theta},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(model.hparam("rope.freq_base_swa", 10000.0)),
            },
        },
        "final_logit_softcapping": model.hparam("final_logit_softcapping"),
        # the file's table (padded to the vocabulary by the converter: those rows are zeros)
        "vocab_size_per_layer_input": int(table.shape[-1]),
        "hidden_size_per_layer_input": model.require_hparam("embedding_length_per_layer_input"),
        "num_kv_shared_layers": model.hparam("attention.shared_kv_layers", 0),
        "altup_active_idx": model.hparam("altup.active_idx", 0),
        "altup_num_inputs": model.hparam("altup.num_inputs", 4),
        "altup_correct_scale": True,
        "laurel_rank": int(laurel.shape[-1]),
        "activation_sparsity_pattern": sparsity,
    }


def _gemma3_config(model: _GGUF, hidden: int, n_head: int, head_dim: int) -> dict:
    """What llama.cpp fixes in code for Gemma 3 rather than storing in the file."""
    layers = model.require_hparam("block_count")
    pattern = model.hparam("attention.sliding_window_pattern", 6)
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        # 27B (62 layers) scales by hidden / heads, the others by head_dim
        "query_pre_attn_scalar": hidden // n_head if layers == 62 else head_dim,
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": model.hparam("final_logit_softcapping"),
        "attn_logit_softcapping": model.hparam("attn_logit_softcapping"),
    }


def _vocab_size(model: _GGUF, tokens: list[str]) -> int:
    embedding = model.tensors.get("token_embd.weight")
    if embedding is not None:
        return int(embedding.shape[-1])
    return model.hparam("vocab_size", len(tokens))


def _torch_dtype(model: _GGUF, names: dict[str, str | None]) -> str:
    dominant = _dominant_type(model, names)
    return {"F16": "float16", "BF16": "bfloat16"}.get(dominant, "float32")


def _rope_scaling(model: _GGUF, theta: float, head_dim: int) -> dict | None:
    kind = model.hparam("rope.scaling.type")
    factor = model.hparam("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = model.hparam("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling
    if kind not in (None, "none"):
        raise model.error(f"unsupported rope scaling type {kind!r}")
    freqs = model.tensors.get("rope_freqs.weight")
    if freqs is None:
        return None
    original = model.hparam("rope.scaling.original_context_length", 8192)
    factors = np.asarray(_dequantize(model, freqs), dtype=np.float64)
    scaling = _llama3_rope_scaling(factors, theta, head_dim, original)
    if scaling is None:
        log.warning(
            "%s: cannot infer llama3 rope scaling from rope_freqs; leaving rope_scaling unset", model.path
        )
    return scaling


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, original: int) -> dict | None:
    """Llama 3.x rope parameters reproducing llama.cpp's `rope_freqs` tensor (stored instead of metadata).

    The tensor fixes `factor` and where the ramp between unscaled and scaled frequencies starts and ends;
    any original context length then gives the same frequencies (and low/high_freq_factor follow from it).
    """
    freqs = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    if len(factors) != len(freqs) or factor <= 1.0:
        return None
    x = freqs / (2 * math.pi)  # 1 / wavelength
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 0: scaled by factor, 1: unscaled
    x_low, x_high = _llama3_ramp(x, smooth)
    exact = (factor, original * x_low, original * x_high)
    for f, low, high in (tuple(float(f"{v:.5g}") for v in exact), exact):
        if low < high and np.allclose(_llama3_factors(freqs, f, low, high, original), factors, rtol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": f,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    return None


def _llama3_ramp(x: np.ndarray, smooth: np.ndarray, eps: float = 1e-5) -> tuple[float, float]:
    """Where the linear ramp `smooth(x)` is 0 and 1: fitted through the ramp points, or placed in the gap."""
    ramp = (smooth > eps) & (smooth < 1 - eps)
    if ramp.sum() >= 2:
        slope, intercept = np.polyfit(x[ramp], smooth[ramp], 1)
        return -intercept / slope, (1 - intercept) / slope
    unscaled, scaled = x[smooth >= 1 - eps], x[smooth <= eps]
    top = unscaled.min() if unscaled.size else 2 * x.max()
    bottom = scaled.max() if scaled.size else x.min() / 2
    if not ramp.any():
        return bottom + (top - bottom) / 3, bottom + 2 * (top - bottom) / 3
    xr, sr = float(x[ramp][0]), float(smooth[ramp][0])
    width = min((top - xr) / (1 - sr), (xr - bottom) / sr)
    return xr - sr * width, xr + (1 - sr) * width


def _llama3_factors(freqs: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    wavelen = 2 * math.pi / freqs
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _generation_config(model: _GGUF) -> dict:
    eos = [model.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if model.arch in ("gemma3", "gemma3n"):  # chat turns end with <end_of_turn>, not always marked as eot
        tokens = model.require("tokenizer.ggml.tokens")
        eos += [i for i, t in enumerate(tokens[:1024]) if t == "<end_of_turn>"]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return {
        "bos_token_id": model.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }


def _dominant_type(model: _GGUF, names: dict[str, str | None]) -> str:
    types = Counter(t.tensor_type.name for t in model.reader.tensors if names[t.name] and len(t.shape) == 2)
    return types.most_common(1)[0][0] if types else "F32"


def _quantization(model: _GGUF, names: dict[str, str | None]) -> dict:
    types: dict[str, str] = {names[t.name]: t.tensor_type.name for t in model.reader.tensors if names[t.name]}
    types["dominant"] = _dominant_type(model, names)
    return types


def _build_tokenizer(model: _GGUF, tokens: list[str]) -> tuple[Tokenizer, dict]:
    kind = model.require("tokenizer.ggml.model")
    types = model.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    try:
        if kind == "gpt2":
            tokenizer = _byte_level_tokenizer(model, tokens, types)
        elif kind in ("llama", "gemma4"):  # gemma4: SentencePiece-style BPE with the file's merges
            tokenizer = _sentencepiece_tokenizer(model, tokens, types)
        else:
            raise model.error(f"unsupported tokenizer model {kind!r} (supported: gpt2, llama, gemma4)")
        _add_special_tokens(tokenizer, tokens, types)
    except GGUFError:
        raise
    except Exception as e:
        raise model.error(f"cannot build the {kind!r} tokenizer ({_one_line(e)})") from e
    config = _tokenizer_config(model, tokens, default_add_bos=kind in ("llama", "gemma4"))
    tokenizer.post_processor = _post_processor(config, kind == "gpt2", tokenizer)
    return tokenizer, config


def _byte_level_tokenizer(model: _GGUF, tokens: list[str], types: list[int]) -> Tokenizer:
    alphabet = set(BYTE_CHARS.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        # Added tokens (control, user-defined) keep their text; a plain token outside the byte alphabet is respelled.
        if kind == 1 and not set(token) <= alphabet:
            token = "".join(BYTE_CHARS[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = _usable_merges(model, vocab, model.require("tokenizer.ggml.merges"))
    pre = model.get("tokenizer.ggml.pre")
    bpe = models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_PRE)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(model, pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(model: _GGUF, pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_PRE:
        log.warning("%s: unknown pre-tokenizer %r, using GPT-2's", model.path, pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_tokenizer(model: _GGUF, tokens: list[str], types: list[int]) -> Tokenizer:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = model.get("tokenizer.ggml.merges")
    if merges is not None:
        merges = _usable_merges(model, vocab, merges)
    else:
        scores = model.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_scores(vocab, tokens, types, scores)
    unk = model.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if unk is not None and unk < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(model.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tokenizer


def _merges_from_scores(
    vocab: dict[str, int], tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a plain token, best score first."""
    ranked = []
    for token, kind, score in zip(tokens, types, scores, strict=True):
        if kind != 1:
            continue
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = sorted((vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab)
        ranked.extend((score, len(a), len(b), a, b) for _, _, a, b in splits)
    ranked.sort(key=lambda m: m[:3], reverse=True)
    return [(a, b) for *_, a, b in ranked]


def _usable_merges(model: _GGUF, vocab: dict[str, int], merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    usable = [p for p in pairs if len(p) == 2 and p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]
    if len(usable) != len(pairs):
        log.warning(
            "%s: dropped %d merges naming tokens not in the vocabulary", model.path, len(pairs) - len(usable)
        )
    return usable


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind == _TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _tokenizer_config(model: _GGUF, tokens: list[str], default_add_bos: bool) -> dict:
    def token(key: str) -> str | None:
        i = model.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(model.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        "add_eos_token": bool(model.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": model.get("tokenizer.chat_template") or _DEFAULT_CHAT_TEMPLATES.get(model.arch),
    }


def _post_processor(config: dict, byte_level: bool, tokenizer: Tokenizer) -> processors.PostProcessor | None:
    """Adds BOS/EOS the way the tokenizer config says, as HF's own tokenizer.json files do."""
    bos = config["bos_token"] if config["add_bos_token"] else None
    eos = config["eos_token"] if config["add_eos_token"] else None
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + single.replace(":0", ":1").replace("$A", "$B")
    specials = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    if byte_level:
        return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return template


def _uniform(model: _GGUF, key: str, value: Any) -> int:
    """Per-layer hyperparameters (lists) are supported only when all layers agree."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise model.error(f"per-layer {key} values {sorted(set(value))} are not supported")
        value = value[0]
    return int(value)


def _field_value(field: gguf.ReaderField) -> Any:
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [_text(field.parts[i]) for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    part = field.parts[field.data[0]]
    return _text(part) if kind == GGUFValueType.STRING else _scalar(part[0])


def _text(part: np.ndarray) -> str:
    return part.tobytes().decode("utf-8", errors="replace")


def _scalar(value: np.generic) -> Any:
    # float32 metadata (1e-5 stored as 9.99999974e-06) reads back as the shortest decimal that round-trips
    return float(str(value)) if isinstance(value, np.float32) else value.item()


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
