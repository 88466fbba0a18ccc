"""A tiny random Nemotron Omni (``nemotron_h_omni``) built with transformers (the reference): the tiny
Nemotron-H of ``tests.tiny`` behind a 2-layer RADIO tower with a video patch projection (patches of
4 pixels, 2-frame tubelets, a 36-patch target grid), and synthetic videos, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.tiny import VOCAB, make_tiny_nemotron_h_checkpoint

OMNI_VOCAB = VOCAB + 64
SPECIAL = ["<image>", "<video>", "<img>", "</img>"]
TOKEN_IDS = {t: VOCAB + i for i, t in enumerate(SPECIAL)}
WORDS = ["Frame", "frame", "sampled", "at", "seconds:", "and"] + [str(i) for i in range(1, 33)]
VISION = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    patch_size=4,
    max_img_size=64,
    num_cls_tokens=2,
    num_registers=2,
    video_temporal_patch_size=2,
)
VIDEO_PROCESSOR = dict(
    patch_size=4,
    video_target_num_patches=36,
    norm_mean=[0.48145466, 0.4578275, 0.40821073],
    norm_std=[0.26862954, 0.26130258, 0.27577711],
    temporal_patch_size=2,
)
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'video' %}<video>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %} {% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def make_model(directory: Path, seed: int = 0):
    """The HF reference (eval, float32), its decoder the tiny Nemotron-H's weights."""
    import transformers

    text_dir = make_tiny_nemotron_h_checkpoint(directory / "text", seed=seed, vocab_size=OMNI_VOCAB)
    text = transformers.NemotronHForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    config = transformers.NemotronH_Omni_Reasoning_V3_Config(
        vision_config=VISION,
        text_config=text.config.to_dict(),
        vision_hidden_size=VISION["hidden_size"],
        projector_hidden_size=48,
        image_token_id=TOKEN_IDS["<image>"],
        video_token_id=TOKEN_IDS["<video>"],
    )
    torch.manual_seed(seed + 1)
    model = transformers.NemotronH_Omni_Reasoning_V3(config).eval()
    model.language_model.load_state_dict(text.state_dict())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("language_model."):
                continue
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.2)
    return model


def make_tiny_nemotron_omni(directory: Path, seed: int = 0) -> Path:
    model = make_model(directory, seed)
    out = directory / "omni"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    return out


def frames(num_frames: int = 5, height: int = 30, width: int = 50, seed: int = 0) -> list[np.ndarray]:
    """A coloured square drifting over a gradient: frames that differ from one another."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for t in range(num_frames):
        img = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 40 * t % 255)], -1)
        top, left = (3 + 2 * t) % (height - 8), (5 + 4 * t) % (width - 8)
        img[top : top + 8, left : left + 8] = rng.integers(0, 255, 3)
        out.append(img.astype(np.uint8))
    return out


def reference_pixels(videos: list[np.ndarray], rows: int, cols: int) -> torch.Tensor:
    """``pixel_values_videos`` as transformers' video processor makes them (its recipe, written out:
    the processor itself needs torchvision): (1, tubelets, 2 * 3, rows * 4, cols * 4)."""
    x = torch.from_numpy(np.stack(videos)).permute(0, 3, 1, 2).float()
    x = torch.nn.functional.interpolate(
        x, size=(rows * 4, cols * 4), mode="bicubic", align_corners=False, antialias=True
    )
    mean = torch.tensor(VIDEO_PROCESSOR["norm_mean"]).view(1, 3, 1, 1)
    std = torch.tensor(VIDEO_PROCESSOR["norm_std"]).view(1, 3, 1, 1)
    x = (x / 255.0 - mean) / std
    if len(x) % 2:
        x = torch.cat([x, x[-1:]])
    return x.reshape(1, -1, 6, rows * 4, cols * 4)


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update(TOKEN_IDS)
    for i, word in enumerate(WORDS):
        vocab[word] = VOCAB + len(SPECIAL) + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2", "chat_template": TEMPLATE})
    )
