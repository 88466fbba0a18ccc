"""A tiny random Nemotron-3.5-ASR checkpoint built with transformers (the reference), for tests.

Two conformer layers over 16 mel bins, a 2-layer LSTM prediction network and a vocabulary of 40
(w0..w38, then <blank>). The weights are drawn wide enough, and the blank's joint bias set, so that
greedy decoding mixes blanks, words and frames that hit ``max_symbols_per_step``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 40
BLANK = VOCAB - 1
ENCODER = dict(
    model_type="nemotron_asr_streaming_encoder",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    subsampling_conv_channels=8,
    num_mel_bins=16,
    conv_kernel_size=5,
    sliding_window=9,  # 8 frames of left context: 2 chunks of 3 + ...
    default_num_lookahead_tokens=2,  # chunks of 3 encoder frames
    max_position_embeddings=300,  # 24 s of audio
    dropout=0.0,
    layerdrop=0.0,
    activation_dropout=0.0,
    attention_dropout=0.0,
)
ENC_STD, DEC_STD, HEAD_STD = 0.3, 0.2, 0.3
LANGUAGES = {"en-US": 0, "en": 0, "de-DE": 1, "de": 1, "fr": 2, "auto": 5}


def make_config(streaming: bool = False, **overrides):
    """``streaming``: the English-only predecessor (``nemotron_asr_streaming``: no language prompt)."""
    import transformers

    if streaming:
        fields = dict(
            vocab_size=VOCAB,
            decoder_hidden_size=24,
            num_decoder_layers=2,
            encoder_config={k: v for k, v in ENCODER.items() if k != "model_type"},
            blank_token_id=BLANK,
            pad_token_id=BLANK,
            max_symbols_per_step=3,
        )
        return transformers.NemotronAsrStreamingConfig(**{**fields, **overrides})
    fields = dict(
        vocab_size=VOCAB,
        decoder_hidden_size=24,
        num_decoder_layers=2,
        encoder_config=ENCODER,
        blank_token_id=BLANK,
        pad_token_id=BLANK,
        num_prompts=8,
        prompt_intermediate_size=48,
        default_prompt_id=5,
        max_symbols_per_step=3,
    )
    return transformers.Nemotron3_5AsrConfig(**{**fields, **overrides})


def make_model(seed: int = 0, blank_bias: float = 5.0, streaming: bool = False, **overrides):
    """The HF reference model (eval, float32)."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.NemotronAsrStreamingForRNNT if streaming else transformers.Nemotron3_5AsrForRNNT
    model = cls(make_config(streaming, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # layer norms near identity: the frames keep what tells them apart
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            elif name.endswith("bias") and p.dim() == 1:
                p.normal_(0, 0.02)
            else:
                p.normal_(0, 0.5 if name.startswith(("joint", "decoder")) else 0.2)
        model.joint.head.bias.zero_()
        model.joint.head.weight.normal_(0, HEAD_STD)
        model.joint.head.bias[BLANK] = blank_bias
        model.encoder_projector.weight.normal_(0, ENC_STD)
        model.decoder.decoder_projector.weight.normal_(0, DEC_STD)
    model.generation_config.decoder_start_token_id = BLANK
    return model


def make_tiny_nemotron_asr(directory: Path, seed: int = 0, streaming: bool = False, **overrides) -> Path:
    """Save the model, a word-level tokenizer (Metaspace pieces, as SentencePiece's) and the
    processor's config (16 mel bins, a small language dictionary) into ``directory``."""
    import transformers

    model = make_model(seed, streaming=streaming, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    features = transformers.NemotronAsrStreamingFeatureExtractor(feature_size=ENCODER["num_mel_bins"])
    if streaming:
        processor = transformers.NemotronAsrStreamingProcessor(
            features, tokenizer, supported_num_lookahead_tokens=[2, 0]
        )
    else:
        processor = transformers.Nemotron3_5AsrProcessor(
            features,
            tokenizer,
            prompt_dictionary=LANGUAGES,
            num_prompts=8,
            supported_num_lookahead_tokens=[2, 0],
        )
    processor.save_pretrained(directory)
    return directory


def words(token_ids: list[int]) -> str:
    """What the tokenizer decodes ``token_ids`` to (blanks dropped), built without transformers."""
    out = "".join(_piece(t) for t in token_ids if t != BLANK)
    return out.replace("\u2581", " ").strip()


def _piece(i: int) -> str:
    return ("\u2581" if i % 3 == 0 else "") + f"w{i}"


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {_piece(i): i for i in range(VOCAB - 1)}
    vocab["<blank>"] = BLANK
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens([AddedToken("<blank>", special=True, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "ParakeetTokenizer",
                "pad_token": "<blank>",
                "bos_token": None,
                "eos_token": None,
            }
        )
    )


def clip(seed: int = 0, rate: int = 16000) -> np.ndarray:
    """About 1.6 s of two tones parted by silence: frames the encoder tells apart."""
    from tests.tiny_asr import tone

    gap = np.zeros(int(0.3 * rate), np.float32)
    return np.concatenate([tone(0.5, seed=seed), gap, tone(0.6, freq=900.0, seed=seed + 1), gap[: rate // 5]])
