"""A tiny random Qwen3-Omni with speech output (thinker, Talker, code predictor, Code2Wav) built with
transformers (the reference), saved as a whole checkpoint with a word-level tokenizer that knows the
role words and the tts_* tokens, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny import VOCAB
from tests.tiny_asr import (
    OMNI_TEMPLATE,
    QWEN3_OMNI_AUDIO,
    QWEN3_OMNI_TEXT,
    QWEN3_OMNI_VISION,
    SPECIAL_TOKENS,
    TOKEN_IDS,
    _randomize,
)

# the thinker's vocabulary (VOCAB + 16) holds the audio tokens, then these
SPEECH_TOKENS = ["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"]
ROLE_WORDS = ["user", "assistant", "system"]
IDS = dict(TOKEN_IDS)
IDS.update({t: VOCAB + len(SPECIAL_TOKENS) + i for i, t in enumerate(SPEECH_TOKENS + ROLE_WORDS)})
VOICES = {"ethan": 1060, "chelsie": 1061, "aiden": 1062}
CODEBOOK = 64  # code predictor vocabulary = Code2Wav's codebook; the Talker's first codes stay under 64
TALKER_VOCAB = 1024 + CODEBOOK  # the top 1024 ids are the codec's special tokens (never sampled but eos)

TALKER = dict(
    text_config=dict(
        vocab_size=TALKER_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=24,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "interleaved": True,
        },
    ),
    code_predictor_config=dict(
        vocab_size=CODEBOOK,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_code_groups=4,
    ),
    num_code_groups=4,
    thinker_hidden_size=64,
    accept_hidden_layer=1,
    codec_eos_token_id=1050,
    codec_nothink_id=1051,
    codec_think_bos_id=1052,
    codec_think_eos_id=1053,
    codec_pad_id=1054,
    codec_bos_id=1055,
    speaker_id=VOICES,
    spatial_merge_size=2,
)
CODE2WAV = dict(
    codebook_size=CODEBOOK,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=64,
    num_hidden_layers=2,
    num_quantizers=4,
    decoder_dim=32,
    sliding_window=8,  # shorter than a test's answer: the window shows
)


def make_tiny_qwen3_omni_speech(directory: Path, seed: int = 0, talker: bool = True) -> Path:
    """Save a random whole Qwen3-Omni (the thinker of ``tests.tiny_asr.make_tiny_qwen3_omni``, a
    2-layer MoE Talker, a 2-layer code predictor over 4 codebooks of 64 codes, a 2-layer Code2Wav with
    the real upsampling: 1920 samples per frame) into ``directory``. ``talker=False``: the same model
    with ``enable_audio_output`` false and no speech tensors."""
    import transformers

    thinker = dict(
        audio_config=QWEN3_OMNI_AUDIO,
        vision_config=QWEN3_OMNI_VISION,
        text_config=QWEN3_OMNI_TEXT,
        audio_token_id=TOKEN_IDS["<|AUDIO|>"],
        audio_start_token_id=TOKEN_IDS["<|audio_bos|>"],
        vision_start_token_id=VOCAB - 1,  # a word no test prompt holds
        tie_word_embeddings=False,
    )
    config = transformers.Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=TALKER,
        code2wav_config=CODE2WAV,
        enable_audio_output=talker,
        im_start_token_id=IDS["<|im_start|>"],
        im_end_token_id=IDS["<|im_end|>"],
        tts_pad_token_id=IDS["<|tts_pad|>"],
        tts_bos_token_id=IDS["<|tts_bos|>"],
        tts_eos_token_id=IDS["<|tts_eos|>"],
        system_token_id=IDS["system"],
        user_token_id=IDS["user"],
        assistant_token_id=IDS["assistant"],
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeForConditionalGeneration(config)
    _randomize(model)
    if talker:
        with torch.no_grad():  # a vocoder that stays inside [-1, 1] (so that the clamp hides nothing)
            last = f"decoder.{len(model.code2wav.decoder) - 1}."
            for name, p in model.code2wav.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, (0.005 if name.startswith(last) else 1.0) / (p[0].numel() ** 0.5))
                elif "norm" in name:
                    p.normal_(1.0, 0.1)
                else:
                    p.normal_(0.0, 0.05)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update(IDS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    special = [t for t in SPECIAL_TOKENS + SPEECH_TOKENS if t != "<asr_text>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": OMNI_TEMPLATE,
            }
        )
    )


def load_hf(directory: Path):
    import transformers

    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    return model.eval()
