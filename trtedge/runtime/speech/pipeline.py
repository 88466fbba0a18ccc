"""Speech from token ids: the Talker's prompt built from a conversation's ids, the Talker's frames,
Code2Wav's waveform in chunks.

The Talker's prompt follows the reference: every user turn (``<|im_start|>user ... <|im_end|>\\n``)
as the thinker's input embeddings through ``text_projection``; then the assistant turn's first three
tokens (``<|im_start|>assistant\\n``) over zeros, four ``tts_pad`` and a ``tts_bos`` over the codec's
nothink, think_bos, think_eos, voice, pad and bos tokens, and the first text token over ``codec_bos``;
the rest of the text (then ``tts_eos``) is added to the Talker's input one token per step.

The Talker only reads the thinker's input embeddings for text. Media in a user turn would need the
thinker's hidden states at ``accept_hidden_layer``, which the engine does not hand out: a prompt with
media is refused (``SpeechInputError``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trtedge.runtime.sampling_params import ParamError
from trtedge.runtime.speech import speech_tensor_names
from trtedge.runtime.speech.code2wav import Code2Wav
from trtedge.runtime.speech.config import SAMPLE_RATE, SpeechConfig
from trtedge.runtime.speech.talker import Talker, TalkerSampling

THINKER_EMBEDDINGS = (
    "thinker.model.embed_tokens.weight",
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
DEFAULT_CHUNK_FRAMES = 25  # 2 s of audio per Code2Wav chunk at 12.5 frames per second


class SpeechInputError(ParamError):
    """A request speech output cannot serve; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(param, message)

    def __reduce__(self):
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class SpeechPrompt:
    prefill: torch.Tensor  # (positions, talker hidden)
    trailing: torch.Tensor  # (text tokens left + tts_eos, talker hidden)
    pad: torch.Tensor  # (talker hidden,)


class SpeechPipeline:
    """The loaded speech components of a Qwen3-Omni bundle: ``voices``, ``prompt(ids, voice)``,
    ``frames(prompt, sampling)`` and ``waveform(frames, chunk_frames)`` (24 kHz float32 pieces)."""

    sample_rate = SAMPLE_RATE

    def __init__(
        self, cfg: SpeechConfig, talker: Talker, code2wav: Code2Wav, thinker_embeddings: torch.Tensor
    ):
        self.cfg = cfg
        self.talker = talker
        self.code2wav = code2wav
        self.embeddings = thinker_embeddings.to(device=talker.device, dtype=talker.dtype)

    @property
    def voices(self) -> list[str]:
        return sorted(self.cfg.speakers)

    @property
    def default_voice(self) -> str:
        return "ethan" if "ethan" in self.cfg.speakers else self.voices[0]

    def voice_id(self, voice: str, param: str = "voice") -> int:
        code = self.cfg.speakers.get(voice.strip().lower()) if isinstance(voice, str) else None
        if code is None:
            raise SpeechInputError(
                f"unknown voice {voice!r}; this model's voices: {', '.join(self.voices)}", param
            )
        return code

    @torch.inference_mode()
    def project(self, ids: list[int]) -> torch.Tensor:
        """Text token ids -> Talker input rows (the thinker's embeddings through text_projection)."""
        rows = self.embeddings[torch.tensor(ids, dtype=torch.long, device=self.embeddings.device)]
        return self.talker.text_projection(rows)

    _project = project

    def answer_start(self, ids: list[int]) -> int:
        """Where the last ``<|im_start|>assistant`` turn starts; SpeechInputError for a prompt the
        Talker cannot speak (media in it, or no assistant turn)."""
        t = self.cfg.text_ids
        if set(ids) & set(self.cfg.multimodal_ids):
            raise SpeechInputError(
                "audio output from a prompt with audio, image or video input is not supported yet "
                "(the Talker would need the thinker's hidden states); send text only",
                "modalities",
            )
        starts = [i for i in range(len(ids) - 1) if ids[i] == t["im_start"] and ids[i + 1] == t["assistant"]]
        if not starts:
            raise SpeechInputError("the prompt has no assistant turn for the Talker to speak", "messages")
        return starts[-1]

    def check(self, ids: list[int], voice: str) -> int:
        """Refuse (``SpeechInputError``) what ``prompt`` cannot speak, on the host; the answer's start."""
        self.voice_id(voice)
        start = self.answer_start(ids)
        if len(ids) - start < 4:
            raise SpeechInputError("there is no text to speak", "input")
        return start

    @torch.inference_mode()
    def prompt(self, ids: list[int], voice: str) -> SpeechPrompt:
        """The Talker's input for a conversation's ``ids``: the prompt and the answer's text tokens
        (without the end-of-turn token), ending inside the last ``<|im_start|>assistant`` turn."""
        t = self.cfg.text_ids
        speaker = self.voice_id(voice)
        start = self.check(ids, voice)
        answer = ids[start:]
        user = []
        role = None
        for i, token in enumerate(ids[:start]):
            if token == t["im_start"]:
                role = ids[i + 1] if i + 1 < len(ids) else None
            if role == t["user"]:
                user.append(token)
        d = self.cfg.talker.hidden_size
        pad, bos, eos = self._project([t["tts_pad"], t["tts_bos"], t["tts_eos"]])
        text = self._project(answer)
        c = self.cfg.codec_ids
        codec = self.talker.embed_codes(
            [c["nothink"], c["think_bos"], c["think_eos"], speaker, c["pad"], c["bos"]]
        )
        head = torch.cat([text[:3], pad.expand(4, d), bos[None], text[3:4]])
        head = head + torch.cat([torch.zeros(3, d, dtype=codec.dtype, device=codec.device), codec])
        prefill = torch.cat([self._project(user), head]) if user else head
        return SpeechPrompt(prefill, torch.cat([text[4:], eos[None]]), pad)

    def frames(self, prompt: SpeechPrompt, sampling: TalkerSampling) -> Iterator[list[int]]:
        return self.talker.frames(prompt.prefill, prompt.trailing, prompt.pad, sampling)

    def waveform(self, frames, chunk_frames: int = DEFAULT_CHUNK_FRAMES) -> Iterator[torch.Tensor]:
        return self.code2wav.chunked(frames, chunk_frames)


def load_speech(cfg: SpeechConfig, tensors, dtype, device) -> SpeechPipeline:
    """The pipeline from (name, tensor) pairs holding the talker.*, code2wav.* and the thinker's
    embedding table."""
    talker: dict[str, torch.Tensor] = {}
    c2w: dict[str, torch.Tensor] = {}
    embeddings = None
    for name, tensor in tensors:
        part = speech_tensor_names(name)
        if part in ("talker", "code_predictor"):
            talker[name.removeprefix("talker.")] = tensor
        elif part == "code2wav":
            c2w[name.removeprefix("code2wav.")] = tensor
        elif name in THINKER_EMBEDDINGS:
            embeddings = tensor
    if embeddings is None:
        raise ValueError("checkpoint has no tensor 'thinker.model.embed_tokens.weight' (the Talker reads it)")
    return SpeechPipeline(
        cfg, Talker(cfg, talker, dtype, device), Code2Wav(cfg, c2w, dtype, device), embeddings
    )
