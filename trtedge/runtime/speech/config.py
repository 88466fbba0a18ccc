"""Qwen3-Omni's speech output configuration, read from the whole model's config.json (``talker_config``,
``code2wav_config`` and the token ids at its top level)."""

from __future__ import annotations

from dataclasses import dataclass, field

SAMPLE_RATE = 24000  # Code2Wav's output: mono, 24 kHz


@dataclass(frozen=True)
class DecoderConfig:
    """One of the small decoders (the Talker's, the code predictor's, Code2Wav's pre-transformer)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int = 0
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, c: dict, where: str, **kw) -> DecoderConfig:
        rope = c.get("rope_parameters") or {}
        try:
            heads = int(c["num_attention_heads"])
            return cls(
                hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                vocab_size=int(c.get("vocab_size", 0)),
                hidden_act=str(c.get("hidden_act", "silu")),
                **kw,
            )
        except KeyError as e:
            raise ValueError(f"config.json {where}: missing required field {e.args[0]!r}") from None


@dataclass(frozen=True)
class SpeechConfig:
    talker: DecoderConfig
    code_predictor: DecoderConfig
    code2wav: DecoderConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    codec_ids: dict[str, int]  # eos, nothink, think_bos, think_eos, pad, bos
    speakers: dict[str, int]  # voice name (lower case) -> its codec token
    text_ids: dict[str, int]  # im_start, user, assistant, system, tts_pad, tts_bos, tts_eos
    codebook_size: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int
    layer_scale: bool = True
    multimodal_ids: tuple[int, ...] = field(default=())

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in self.upsample_rates + self.upsampling_ratios:
            n *= r
        return n

    @property
    def frames_per_second(self) -> float:
        return SAMPLE_RATE / self.samples_per_frame

    @classmethod
    def from_hf(cls, cfg: dict) -> SpeechConfig | None:
        """None for a config without speech output (no talker, or ``enable_audio_output`` false)."""
        talker, c2w = cfg.get("talker_config"), cfg.get("code2wav_config")
        if not talker or not c2w or cfg.get("enable_audio_output", True) is False:
            return None
        text = talker.get("text_config") or {}
        cp = talker.get("code_predictor_config") or {}
        t = DecoderConfig.from_hf(
            text,
            "talker_config.text_config",
            num_experts=int(text.get("num_experts") or text.get("num_local_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(text.get("norm_topk_prob", False)),
        )
        p = DecoderConfig.from_hf(cp, "talker_config.code_predictor_config")
        w = DecoderConfig.from_hf(c2w, "code2wav_config", sliding_window=c2w.get("sliding_window", 72))
        if t.num_experts <= 0 or t.shared_expert_intermediate_size <= 0:
            raise ValueError(
                "config.json talker_config.text_config: the Talker needs num_experts and a shared expert"
            )
        names = ("eos_token", "nothink", "think_bos", "think_eos", "pad", "bos")
        defaults = (4198, 4203, 4204, 4205, 4196, 4197)
        codec = {
            n.removesuffix("_token"): int(talker.get(f"codec_{n}_id", d)) for n, d in zip(names, defaults)
        }
        thinker = cfg.get("thinker_config") or {}
        top = {
            "im_start": ("im_start_token_id", 151644),
            "user": ("user_token_id", 872),
            "assistant": ("assistant_token_id", 77091),
            "system": ("system_token_id", 8948),
            "tts_pad": ("tts_pad_token_id", 151671),
            "tts_bos": ("tts_bos_token_id", 151672),
            "tts_eos": ("tts_eos_token_id", 151673),
        }
        mm = tuple(
            int(thinker[k]) for k in ("audio_token_id", "image_token_id", "video_token_id") if k in thinker
        )
        return cls(
            talker=t,
            code_predictor=p,
            code2wav=w,
            num_code_groups=int(talker.get("num_code_groups", 32)),
            thinker_hidden_size=int(talker.get("thinker_hidden_size", 2048)),
            accept_hidden_layer=int(talker.get("accept_hidden_layer", 18)),
            codec_ids=codec,
            speakers={str(k).lower(): int(v) for k, v in (talker.get("speaker_id") or {}).items()},
            text_ids={k: int(cfg.get(name, d)) for k, (name, d) in top.items()},
            codebook_size=int(c2w.get("codebook_size", 2048)),
            upsample_rates=tuple(int(r) for r in c2w.get("upsample_rates", (8, 5, 4, 3))),
            upsampling_ratios=tuple(int(r) for r in c2w.get("upsampling_ratios", (2, 2))),
            decoder_dim=int(c2w.get("decoder_dim", 1536)),
            multimodal_ids=mm,
        )
