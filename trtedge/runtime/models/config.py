"""Model configuration read from a Hugging Face config.json dict."""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gemma3_text",
    "gemma3",
)
SUPPORTED_MODEL_TYPES += ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_MODEL_TYPES += ("qwen2_5_vl", "qwen3_vl", "qwen3_asr", "qwen2_5_omni", "qwen2_5_omni_thinker")
SUPPORTED_MODEL_TYPES += ("qwen3_omni_moe", "qwen3_omni_moe_thinker")
SUPPORTED_MODEL_TYPES += ("gemma3n", "gemma3n_text", "gemma4", "gemma4_text")
SUPPORTED_MODEL_TYPES += ("nemotron_h", "nemotron_h_omni", "nemotron3_5_asr", "nemotron_asr_streaming")
# RNN-T transcribers: no language model; served by runtime.transducer, transcription only.
_TRANSDUCER_VOCAB = {"nemotron3_5_asr": 13088, "nemotron_asr_streaming": 1025}  # transformers' defaults
TRANSDUCER_MODEL_TYPES = ("nemotron3_5_asr", "nemotron_asr_streaming")
# Gemma 3n / Gemma 4 (per-layer embeddings): the multimodal checkpoint -> its text model's type.
_PLE_FAMILIES = {"gemma3n": "gemma3n_text", "gemma4": "gemma4_text"}
PLE_MODEL_TYPES = ("gemma3n_text", "gemma4_text")
# Omni checkpoints (whole, or their thinker alone) -> the family their thinker is served as.
_OMNI = {
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni_moe",
    "qwen3_omni_moe_thinker": "qwen3_omni_moe",
}
# Hybrid (Gated DeltaNet + gated attention) checkpoints, vision-language or text-only -> the text
# model's family.
_QWEN3_5 = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to / past the original length
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # multiplies cos and sin
    partial_rotary_factor: float = 1.0  # proportional (Gemma 4): the rotated share of each head


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers of a hybrid model (Qwen3.5): which layers they are and their shapes."""

    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer_types: unknown layer type(s) {sorted(unknown)}")
        if self.num_value_heads % self.num_key_heads:
            raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0
    # Per layer: the number of most recent keys a query sees (0: the whole context).
    sliding_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None  # rope of the sliding-window layers, where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default: head_dim)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts: which layers are sparse, and their routing.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    linear: LinearAttentionConfig | None = None  # hybrid models: their linear-attention layers
    # Vision-language models (Qwen2.5-VL): rotary sections (temporal, height, width) of M-RoPE, and
    # the config.json fields of the vision encoder (vision_config, placeholder token ids).
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # Qwen3-VL: the sections interleave (t, h, w, t, h, w, ...)
    vision: dict | None = None
    # Audio-language models (Qwen3-ASR): the config.json fields of the audio encoder (audio_config,
    # the placeholder token id).
    audio: dict | None = None
    # Gemma 3n / Gemma 4: the text config.json fields the family reads itself (per-layer embeddings,
    # head sizes per layer, KV sharing, AltUp); num_kv_heads x head_dim is then the widest layer's.
    # Nemotron-H: its layer types and Mamba-2 / MoE fields.
    text_config: dict | None = None
    # Multi-token-prediction layers shipped beside the model (``mtp.*``: Qwen3.5 / Qwen3-Next's
    # mtp_num_hidden_layers, Nemotron-H's and DeepSeek-V3's num_nextn_predict_layers);
    # the model skips them, the speculative ``mtp`` method drafts with them.
    num_mtp_layers: int = 0

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (False,) * self.num_layers)
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type in _QWEN3_5:  # the vision-language checkpoint: its text model
            top = cfg
            cfg = dict(cfg.get("text_config") or cfg)
            cfg.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
            cfg.setdefault("torch_dtype", top.get("torch_dtype") or top.get("dtype"))
            rope = cfg.get("rope_parameters") or {}
            cfg.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
            cfg["model_type"] = model_type = _QWEN3_5[model_type]
        vision = None
        if model_type in ("qwen2_5_vl", "qwen3_vl"):  # qwen2's / qwen3's text model (+ M-RoPE)
            top = cfg
            cfg = {**cfg, **(cfg.get("text_config") or {}), "model_type": model_type}
            cfg.setdefault("torch_dtype", top.get("torch_dtype") or top.get("dtype"))
            keys = (
                "vision_config",
                "image_token_id",
                "video_token_id",
                "vision_start_token_id",
                "vision_end_token_id",
            )
            vision = {k: top[k] for k in keys if k in top}
        audio = None
        if model_type == "qwen3_asr":  # qwen3's text model behind an audio encoder
            top = cfg
            cfg = {**(cfg.get("text_config") or {}), "model_type": model_type}
            cfg["tie_word_embeddings"] = top.get("tie_word_embeddings", True)
            cfg.setdefault("torch_dtype", top.get("torch_dtype") or top.get("dtype"))
            audio = {k: top[k] for k in ("audio_config", "audio_token_id") if k in top}
        if model_type in _OMNI:  # the thinker: qwen2's (Qwen2.5-Omni) or qwen3_moe's (Qwen3-Omni) text model
            thinker = cfg.get("thinker_config") or cfg
            text = thinker.get("text_config") or {}
            model_type = _OMNI[model_type]
            cfg = {**text, "model_type": model_type}
            cfg["tie_word_embeddings"] = thinker.get(
                "tie_word_embeddings", text.get("tie_word_embeddings", False)
            )
            cfg.setdefault("torch_dtype", thinker.get("torch_dtype") or thinker.get("dtype"))
            audio = {"audio_config": thinker.get("audio_config") or {}}
            audio["audio_token_id"] = thinker.get("audio_token_index", thinker.get("audio_token_id", 151646))
        if model_type in TRANSDUCER_MODEL_TYPES:  # the encoder's shapes stand in for the text model's
            top = cfg
            enc = cfg.get("encoder_config") or {}
            cfg = {
                **enc,
                "model_type": model_type,
                "vocab_size": top.get("vocab_size", _TRANSDUCER_VOCAB[model_type]),
            }
            cfg.setdefault("torch_dtype", top.get("torch_dtype") or top.get("dtype"))
            cfg["max_position_embeddings"] = enc.get("max_position_embeddings", 5000)
            audio = {"audio_config": enc}
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "gemma3":  # the multimodal checkpoint: its text model
            cfg = {**cfg.get("text_config", {}), "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        if model_type in _PLE_FAMILIES:  # likewise for Gemma 3n / Gemma 4
            top = cfg
            cfg = {**cfg.get("text_config", {}), "model_type": _PLE_FAMILIES[model_type]}
            cfg.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", True))
            cfg.setdefault("torch_dtype", top.get("torch_dtype") or top.get("dtype"))
            model_type = cfg["model_type"]
        if model_type in PLE_MODEL_TYPES:
            cfg = _ple_text_config(cfg, source)
        if model_type == "nemotron_h_omni":  # Nemotron Omni: the Nemotron-H decoder behind a video tower
            vision = _nemotron_omni_vision(cfg)
            top = cfg
            cfg = {**(cfg.get("text_config") or cfg.get("llm_config") or {}), "model_type": "nemotron_h"}
            cfg.setdefault("torch_dtype", top.get("torch_dtype") or top.get("dtype"))
            model_type = "nemotron_h"
        if model_type == "nemotron_h":
            cfg = _nemotron_h_config(cfg, source)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            attention_bias = bool(cfg.get("attention_bias", False))
            gemma = model_type in ("gemma3_text", *PLE_MODEL_TYPES)
            ple = model_type in PLE_MODEL_TYPES
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(max(_as_list(cfg["intermediate_size"]))),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(cfg["_cache_kv_heads"] if ple else cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg["_cache_head_dim"] if ple else cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rope=_rope_config(cfg, source, "full_attention"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                qkv_bias=model_type in ("qwen2", "qwen2_5_vl", "qwen2_5_omni")
                or attention_bias
                or _qwen2_moe_bias(cfg),
                o_bias=model_type in ("llama", "mistral") and attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type
                in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_vl", "qwen3_asr", "qwen3_omni_moe")
                or model_type in _QWEN3_5
                or ple,
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
                partial_rotary_factor=_partial_rotary_factor(cfg),
                sliding_windows=_sliding_windows(cfg, num_layers),
                local_rope=_rope_config(cfg, source, "sliding_attention") if gemma else None,
                # Gemma 3n / 4 scale queries by their RMSNorm alone (attention scale 1)
                query_pre_attn_scalar=1.0 if ple else cfg.get("query_pre_attn_scalar") if gemma else None,
                # Gemma 3 keeps the field but, like HF transformers, does not cap attention scores.
                attn_logit_softcapping=None if gemma else cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                **_moe_fields(cfg, model_type, num_layers),
                linear=_linear_config(cfg, num_layers) if model_type in _QWEN3_5 else None,
                mrope_section=_mrope_section(cfg)
                if vision is not None and model_type != "nemotron_h"
                else (),
                mrope_interleaved=model_type == "qwen3_vl",
                vision=vision,
                audio=audio,
                text_config=_text_config(
                    model_type, cfg, top if model_type in TRANSDUCER_MODEL_TYPES else None
                ),
                num_mtp_layers=_num_mtp_layers(cfg),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"{source}: missing required field {e.args[0]!r}") from None


def _num_mtp_layers(cfg: dict) -> int:
    # Nemotron-H configs list mtp_layers_block_type whether or not the checkpoint has MTP layers: its
    # num_nextn_predict_layers (default 0) says whether it does
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def _nemotron_omni_vision(cfg: dict) -> dict:
    """Nemotron Omni's vision fields (the released configs' older names read too)."""
    image = cfg.get("image_token_id", cfg.get("img_context_token_id"))
    if float(cfg.get("video_pruning_rate") or 0.0) > 0:
        raise UnsupportedModelError(
            "config.json: video_pruning_rate > 0 (Efficient Video Sampling drops video tokens) is not supported yet"
        )
    return {
        "family": "nemotron_h_omni",
        "vision_config": cfg.get("vision_config") or {},
        "image_token_id": image,
        "video_token_id": cfg.get("video_token_id", cfg.get("video_context_token_id")),
        "downsample_ratio": cfg.get("downsample_ratio", 0.5),
        "video_temporal_patch_size": cfg.get("video_temporal_patch_size", 2),
        "video_pruning_rate": cfg.get("video_pruning_rate", 0.0),
    }


def _text_config(model_type: str, cfg: dict, top: dict | None) -> dict | None:
    """The config fields a family reads itself: a transducer's whole config.json, the text config of
    Gemma 3n / Gemma 4 and Nemotron-H."""
    if top is not None:
        return top
    return cfg if model_type in (*PLE_MODEL_TYPES, "nemotron_h") else None


def _linear_config(cfg: dict, num_layers: int) -> LinearAttentionConfig:
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return LinearAttentionConfig(
        layer_types=tuple(layer_types),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
    )


def _sliding_windows(cfg: dict, num_layers: int) -> tuple[int, ...]:
    window = int(cfg.get("sliding_window") or 0)
    qwen = cfg.get("model_type") in (
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "qwen2_5_vl",
        "qwen3_asr",
        "qwen2_5_omni",
        "qwen3_omni_moe",
    )
    if not window or (qwen and not cfg.get("use_sliding_window")):
        return (0,) * num_layers
    types = cfg.get("layer_types")
    if types is None and qwen:
        first = int(cfg.get("max_window_layers") or 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is None and cfg.get("model_type") in ("gemma3n_text", "gemma4_text"):
        pattern = 5 if cfg["model_type"] == "gemma3n_text" else 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None and cfg.get("model_type") == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None:
        return (window,) * num_layers
    return tuple(window if t == "sliding_attention" else 0 for t in types[:num_layers])


# transformers' config defaults where a checkpoint leaves norm_topk_prob out (qwen2_moe, qwen3_moe:
# False); mixtral and qwen3_5_moe always renormalise.
_NORM_TOPK_DEFAULT = {"qwen3_next": True}


def _moe_fields(cfg: dict, model_type: str, num_layers: int) -> dict:
    if model_type == "gemma4_text":  # every layer: a dense MLP beside top-k experts
        if not cfg.get("enable_moe_block"):
            return {}
        return dict(
            num_experts=int(cfg["num_experts"]),
            num_experts_per_tok=int(cfg["top_k_experts"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
        )
    if model_type not in ("qwen2_moe", "qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_next", "qwen3_omni_moe"):
        return {}
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if model_type == "mixtral":
        sparse = (experts > 0,) * num_layers
        size = int(cfg["intermediate_size"])
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        size = int(cfg["moe_intermediate_size"])
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=size,
        norm_topk_prob=model_type in ("mixtral", "qwen3_5_moe")
        or bool(cfg.get("norm_topk_prob", _NORM_TOPK_DEFAULT.get(model_type, False))),
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def _qwen2_moe_bias(cfg: dict) -> bool:
    return cfg.get("model_type") == "qwen2_moe" and bool(cfg.get("qkv_bias", True))


def _mrope_section(cfg: dict) -> tuple[int, ...]:
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    section = params.get("mrope_section")
    if not section:
        raise UnsupportedModelError("config.json: a vision-language text model needs rope mrope_section")
    return tuple(int(n) for n in section)


def _partial_rotary_factor(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)


def _rope_config(cfg: dict, source: str, layer_type: str) -> RopeConfig:
    # transformers 5 keeps rope settings in `rope_parameters` (Gemma 3: one entry per layer type);
    # 4.x in `rope_theta` + `rope_scaling` (Gemma 3: `rope_local_base_freq` for sliding layers).
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type in params or "full_attention" in params:
        params = dict(params.get(layer_type) or {})
    scaling = {} if layer_type == "sliding_attention" else (cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    default_theta = 10000.0
    if layer_type == "sliding_attention":
        default_theta = cfg.get("rope_local_base_freq", 10000.0)
    elif cfg.get("model_type") in ("gemma3_text", "gemma3n_text", "gemma4_text"):
        default_theta = 1000000.0
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", default_theta)))
    if layer_type == "sliding_attention" and "rope_theta" not in merged:
        theta = float(default_theta)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind in ("default", "mrope"):  # mrope: M-RoPE sections over the default frequencies
        return RopeConfig(theta=theta)
    if kind == "proportional":  # Gemma 4's global layers: the first share of the pairs rotates
        return RopeConfig(
            theta=theta,
            kind="proportional",
            factor=float(merged.get("factor", 1.0)),
            partial_rotary_factor=float(merged.get("partial_rotary_factor", 1.0)),
        )
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
    if kind in ("longrope", "su"):
        original = int(
            merged.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or 4096
        )
        factor = merged.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
        attention = merged.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeConfig(
            theta=theta,
            kind="longrope",
            factor=float(factor),
            original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in merged["short_factor"]),
            long_factor=tuple(float(f) for f in merged["long_factor"]),
            attention_factor=float(attention),
        )
    raise UnsupportedModelError(
        f"{source}: unsupported rope type {kind!r}; supported: default, linear, llama3, longrope, proportional"
    )


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# Nemotron-H's layer types (config.json: ``layers_block_type``, older ones ``hybrid_override_pattern``).
NEMOTRON_H_LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
_NEMOTRON_H_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h_config(cfg: dict, source: str) -> dict:
    """Nemotron-H with its layer types resolved (one per layer) and the fields ModelConfig reads under
    their usual names; the family reads the Mamba-2 and MoE fields itself (``text_config``)."""
    cfg = dict(cfg)
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and cfg.get("hybrid_override_pattern"):
        pattern = str(cfg["hybrid_override_pattern"])
        unknown = sorted(set(pattern) - set(_NEMOTRON_H_PATTERN))
        if unknown:
            raise UnsupportedModelError(f"{source}: hybrid_override_pattern: unknown layer code(s) {unknown}")
        types = [_NEMOTRON_H_PATTERN[ch] for ch in pattern]
    if not types:
        raise UnsupportedModelError(f"{source}: missing required field 'layers_block_type'")
    types = [_NEMOTRON_H_LEGACY.get(t, t) for t in types]
    unknown = sorted(set(types) - set(NEMOTRON_H_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"{source}: layers_block_type: unknown layer type(s) {unknown}; "
            f"supported: {', '.join(NEMOTRON_H_LAYER_TYPES)}"
        )
    cfg["layers_block_type"] = types
    cfg["num_hidden_layers"] = len(types)
    cfg.setdefault("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-5))
    cfg["hidden_act"] = cfg.get("mlp_hidden_act", "relu2")
    cfg.setdefault("num_attention_heads", 32)
    cfg.setdefault("num_key_value_heads", 8)
    cfg.setdefault("head_dim", 128)
    cfg.setdefault("intermediate_size", 21504)
    cfg["attention_bias"] = False  # transformers' Nemotron-H projections have none (biases load if present)
    return cfg


def _ple_text_config(cfg: dict, source: str) -> dict:
    """Gemma 3n / Gemma 4 text config with its per-layer attention shapes resolved (``_layer_shapes``:
    (kv heads, head dim) per layer, as transformers' per_layer_config has them) and the KV cache's
    row: the widest layer's."""
    cfg = dict(cfg)
    num_layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    types = cfg.get("layer_types")
    if types is None:
        pattern = 5 if cfg["model_type"] == "gemma3n_text" else 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    cfg["layer_types"] = list(types)
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention 'all' (a non-causal model)")
    shapes = []
    per_layer = cfg.get("per_layer_config")
    for i, kind in enumerate(types):
        dim, kv = head_dim, kv_heads
        if cfg["model_type"] == "gemma4_text" and kind == "full_attention":
            if per_layer is not None:
                override = per_layer.get(str(i)) or per_layer.get(i) or {}
                dim = int(override.get("head_dim", dim))
                kv = int(override.get("num_key_value_heads", kv))
            else:
                dim = int(cfg.get("global_head_dim") or 512)
                if cfg.get("attention_k_eq_v", True) and cfg.get("num_global_key_value_heads"):
                    kv = int(cfg["num_global_key_value_heads"])
        shapes.append((kv, dim))
    cfg["_layer_shapes"] = shapes
    kv, dim = max(shapes, key=lambda s: s[0] * s[1])
    if any((kv * dim) % k for k, _ in shapes):
        raise UnsupportedModelError(
            f"{source}: KV heads per layer {sorted({k for k, _ in shapes})} do not divide the widest row"
        )
    cfg["_cache_kv_heads"], cfg["_cache_head_dim"] = kv, dim
    return cfg
