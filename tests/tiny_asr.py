"""A tiny random Qwen3-ASR checkpoint built with transformers (the reference), and synthesized clips,
for tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from tests.tiny import VOCAB

SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<asr_text>",
    "<|endoftext|>",
    "<|audio_bos|>",  # Qwen2.5-Omni's audio markers
    "<|AUDIO|>",
    "<|audio_eos|>",
]
TOKEN_IDS = {t: VOCAB + i for i, t in enumerate(SPECIAL_TOKENS)}
ASR_VOCAB = VOCAB + 16

# Like Qwen3-ASR's template: each audio part becomes <|audio_start|><|audio_pad|><|audio_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif 'text' in content %} {{ content['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Like Qwen2.5-Omni's: <|audio_bos|><|AUDIO|><|audio_eos|>.
OMNI_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|audio_start|><|audio_pad|><|audio_end|>", "<|audio_bos|><|AUDIO|><|audio_eos|>"
)

# Chunks of 100 mel frames (1 s, 13 tokens); attention windows of 2 chunks (26 tokens).
AUDIO = dict(
    num_mel_bins=128,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    d_model=32,
    output_dim=64,
    n_window=50,
    n_window_infer=200,
    downsample_hidden_size=8,
    max_position_embeddings=13,
)
TEXT = dict(
    vocab_size=ASR_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=TOKEN_IDS["<|endoftext|>"],
    eos_token_id=TOKEN_IDS["<|im_end|>"],
)


def make_tiny_qwen3_asr(directory: Path, seed: int = 0) -> Path:
    """Save a random Qwen3-ASR (2 encoder layers, 2 text layers) with a word-level tokenizer (w0..w511
    plus the Qwen audio special tokens) and a Qwen-style chat template into ``directory``."""
    import transformers

    config = transformers.Qwen3ASRConfig(
        audio_config=AUDIO,
        text_config=TEXT,
        audio_token_id=TOKEN_IDS["<|audio_pad|>"],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=TOKEN_IDS["<|im_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ASRForConditionalGeneration(config)
    _randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {"feature_extractor_type": "Qwen3ASRFeatureExtractor", "feature_size": 128, "n_window": 50}
        )
    )
    return directory


OMNI_AUDIO = dict(
    num_mel_bins=128,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    d_model=32,
    output_dim=64,
    n_window=50,  # chunks of 100 frames: a 1.6 s clip is cut in two
    max_source_positions=1500,
)
OMNI_TEXT = dict(
    TEXT,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    tie_word_embeddings=False,
)
OMNI_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)


def make_tiny_qwen2_5_omni(directory: Path, seed: int = 0) -> Path:
    """Save a random Qwen2.5-Omni thinker (2 audio encoder layers, 2 text layers, a 1-block vision
    tower trtedge does not load) with the same tokenizer and an Omni-style template into ``directory``."""
    import transformers

    config = transformers.Qwen2_5OmniThinkerConfig(
        audio_config=OMNI_AUDIO,
        vision_config=OMNI_VISION,
        text_config=OMNI_TEXT,
        audio_token_index=TOKEN_IDS["<|AUDIO|>"],
        audio_start_token_id=TOKEN_IDS["<|audio_bos|>"],
        audio_end_token_id=TOKEN_IDS["<|audio_eos|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(config)
    _randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory, OMNI_TEMPLATE)
    return directory


def _randomize(model) -> None:
    """Random weights (norms around 1, not identity, so that a wrong formula shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") or "ln_post.weight" in name:
                p.normal_(1.0, 0.2)
            elif "conv" in name and p.dim() >= 2:  # loud enough that the clip, not the position, shows
                p.normal_(0.0, 0.6)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.eval()


def _write_tokenizer(directory: Path, template: str = CHAT_TEMPLATE) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update(TOKEN_IDS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    # <asr_text> is an ordinary added token, as in Qwen3-ASR's tokenizer: it stays in decoded text
    special = [t for t in SPECIAL_TOKENS if t != "<asr_text>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken("<asr_text>", special=False, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
            }
        )
    )


def tone(seconds: float, rate: int = 16000, freq: float = 440.0, seed: int = 0) -> np.ndarray:
    """A tone with a vowel-like formant sweep and a little noise (float32 mono in [-1, 1])."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * freq * t) + 0.2 * np.sin(2 * np.pi * (700 + 500 * t) * t)
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2  # syllable-like envelope
    return (x + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def encode_clip(samples: np.ndarray, fmt: str, rate: int = 16000, channels: int = 1) -> bytes:
    """``samples`` encoded in a container with PyAV: wav, flac, mp3, ogg (Opus), m4a (AAC), webm (Opus)."""
    import av

    codec, container, layout_rate = {
        "wav": ("pcm_s16le", "wav", rate),
        "flac": ("flac", "flac", rate),
        "mp3": ("libmp3lame", "mp3", rate),
        "ogg": ("libopus", "ogg", 48000),
        "m4a": ("aac", "mp4", rate),
        "webm": ("libopus", "webm", 48000),
    }[fmt]
    data = np.tile(samples[None, :], (channels, 1)).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=layout_rate)
        stream.layout = "mono" if channels == 1 else "stereo"
        frame = av.AudioFrame.from_ndarray(data, format="fltp", layout=stream.layout.name)
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.format.name, layout=stream.layout.name, rate=layout_rate)
        for chunk in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(chunk):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def make_tiny_qwen2_5_omni_full(directory: Path, seed: int = 0) -> Path:
    """The thinker of ``make_tiny_qwen2_5_omni`` laid out as a whole Qwen2.5-Omni checkpoint: config
    model_type qwen2_5_omni with thinker_config, tensors under thinker., plus a stand-in talker tensor
    (which trtedge leaves out)."""
    from safetensors.torch import load_file, save_file

    thinker = make_tiny_qwen2_5_omni(directory.with_name(directory.name + "-thinker"), seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"thinker.{k}": v for k, v in load_file(thinker / "model.safetensors").items()}
    tensors["talker.codec_head.weight"] = torch.randn(8, 64)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    thinker_config = json.loads((thinker / "config.json").read_text())
    config = {
        "model_type": "qwen2_5_omni",
        "architectures": ["Qwen2_5OmniModel"],
        "thinker_config": thinker_config,
    }
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((thinker / name).read_bytes())
    return directory


QWEN3_OMNI_AUDIO = dict(AUDIO, conv_chunksize=500, max_source_positions=1500)
QWEN3_OMNI_TEXT = dict(
    TEXT,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "interleaved": True,
    },
)
QWEN3_OMNI_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    deepstack_visual_indexes=[],
)


def make_tiny_qwen3_omni(directory: Path, seed: int = 0) -> Path:
    """Save a random Qwen3-Omni thinker (Qwen3-ASR's tiny audio encoder, 2 MoE text layers of 4 experts,
    top 2, a 1-block vision tower trtedge does not load) with the Omni-style template into ``directory``."""
    import transformers

    config = transformers.Qwen3OmniMoeThinkerConfig(
        audio_config=QWEN3_OMNI_AUDIO,
        vision_config=QWEN3_OMNI_VISION,
        text_config=QWEN3_OMNI_TEXT,
        audio_token_id=TOKEN_IDS["<|AUDIO|>"],
        audio_start_token_id=TOKEN_IDS["<|audio_bos|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config)
    _randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory, OMNI_TEMPLATE)
    return directory
