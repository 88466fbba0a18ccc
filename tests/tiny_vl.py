"""A tiny random Qwen2.5-VL checkpoint built with transformers (the reference) for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny import VOCAB

# Special tokens after the word vocabulary (w0..w511), ids as in this order.
SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|endoftext|>",
]
TOKEN_IDS = {t: VOCAB + i for i, t in enumerate(SPECIAL_TOKENS)}
VL_VOCAB = VOCAB + 16

# Like the real Qwen2.5-VL template: each image part becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %} {{ content['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Patch 4 x merge 2: one placeholder token per 8x8 pixels; windows of 2x2 merged patches (16 px).
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,
    fullatt_block_indexes=[1],
    tokens_per_second=2,
    hidden_act="silu",
)
TEXT = dict(
    vocab_size=VL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    bos_token_id=TOKEN_IDS["<|endoftext|>"],
    eos_token_id=TOKEN_IDS["<|im_end|>"],
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 8 * 8 * 4,
    "max_pixels": 8 * 8 * 64,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}


def make_tiny_qwen2_5_vl(directory: Path, seed: int = 0) -> Path:
    """Save a random Qwen2.5-VL (2 text layers, 3 vision blocks: window, full, window attention) with a
    word-level tokenizer (w0..w511 plus the Qwen vision special tokens), a Qwen-style chat template and
    preprocessor_config.json (images of 16..64 placeholder tokens) into ``directory``."""
    return _save_random("Qwen2_5_VL", TEXT, VISION, directory, seed)


def write_vl_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update(TOKEN_IDS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def random_image(width: int = 40, height: int = 56, seed: int = 0):
    """A deterministic random RGB PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


QWEN3_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
)
QWEN3_TEXT = dict(
    TEXT,
    num_hidden_layers=3,
    head_dim=16,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)


def make_tiny_qwen3_vl(directory: Path, seed: int = 0) -> Path:
    """Save a random Qwen3-VL (3 text layers, 3 vision blocks, DeepStack after blocks 0 and 1, a 4x4
    learned position grid) with the same tokenizer, template and preprocessor config as above."""
    return _save_random("Qwen3VL", QWEN3_TEXT, QWEN3_VISION, directory, seed)


def _save_random(family: str, text: dict, vision: dict, directory: Path, seed: int) -> Path:
    """``transformers.<family>ForConditionalGeneration`` with random weights (norms around 1, not
    identity, so that a wrong formula shows), the tokenizer and the preprocessor config."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm1." in name or ".norm2." in name or "ln_q" in name:
                p.normal_(1.0, 0.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_vl_tokenizer(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return directory
