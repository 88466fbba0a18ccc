"""What ``LLM`` runs for speech output: the options a request may set (the reference's names), the
text-to-speech prompt, and the stream of waveform pieces."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trtedge.runtime.speech import speech_tensor_names
from trtedge.runtime.speech.pipeline import DEFAULT_CHUNK_FRAMES, SpeechInputError, SpeechPipeline
from trtedge.runtime.speech.talker import TalkerSampling

MAX_AUDIO_SECONDS = 600.0
NO_SPEECH = "this model has no speech output (no Talker / Code2Wav components)"


@dataclass(frozen=True)
class SpeechOptions:
    """``talker_temperature`` (0 = greedy), ``talker_top_k``, ``talker_top_p``, ``repetition_penalty``
    (on the Talker's codes), ``max_audio_length`` (seconds of audio at most), ``codec_chunk_frames``
    (frames per Code2Wav chunk: the streaming granularity, 12.5 frames a second),
    ``talker_prefill_threshold`` (answer tokens the thinker must have made before the Talker starts,
    when it speaks an answer still being generated: ``LiveSpeech``), ``seed``,
    ``speed`` (0.25 to 4 times as fast, the pitch kept)."""

    voice: str | None = None
    talker_temperature: float = 0.9
    talker_top_k: int = 50
    talker_top_p: float = 1.0
    repetition_penalty: float = 1.05
    max_audio_length: float = MAX_AUDIO_SECONDS
    codec_chunk_frames: int = DEFAULT_CHUNK_FRAMES
    talker_prefill_threshold: int = 1
    seed: int | None = None
    speed: float = 1.0  # 0.25 to 4, the pitch kept (PyAV's atempo filter)

    def __post_init__(self) -> None:
        def bad(name: str, what: str):
            raise SpeechInputError(f"{name} must be {what}, got {getattr(self, name)!r}", name)

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "a number")
            return float(v)

        def integer(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(name, f"an integer >= {low}")

        if self.voice is not None and not isinstance(self.voice, str):
            bad("voice", "a string")
        if not 0.0 <= number("talker_temperature") <= 2.0:
            bad("talker_temperature", "in [0, 2]")
        integer("talker_top_k", 0)
        if not 0.0 < number("talker_top_p") <= 1.0:
            bad("talker_top_p", "in (0, 1]")
        if not 0.0 < number("repetition_penalty") <= 2.0:
            bad("repetition_penalty", "in (0, 2]")
        if not 0.0 < number("max_audio_length") <= MAX_AUDIO_SECONDS:
            bad("max_audio_length", f"in (0, {MAX_AUDIO_SECONDS:g}] seconds")
        integer("codec_chunk_frames", 1)
        if self.codec_chunk_frames > 300:
            bad("codec_chunk_frames", "at most 300")
        integer("talker_prefill_threshold", 1)
        if self.seed is not None:
            integer("seed", 0)
        if not 0.25 <= number("speed") <= 4.0:
            bad("speed", "in [0.25, 4]")

    @classmethod
    def coerce(cls, value) -> SpeechOptions:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError("speech options must be a SpeechOptions or a dict")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            name = sorted(unknown)[0]
            raise SpeechInputError(f"unknown speech option {name!r}", name)
        return cls(**value)

    def sampling(self, frames_per_second: float) -> TalkerSampling:
        return TalkerSampling(
            temperature=float(self.talker_temperature),
            top_k=self.talker_top_k,
            top_p=float(self.talker_top_p),
            repetition_penalty=float(self.repetition_penalty),
            max_frames=max(1, int(self.max_audio_length * frames_per_second + 1e-6)),
            seed=self.seed,
        )


@dataclass(frozen=True)
class SpeechOutput:
    """A whole answer's speech: float32 mono ``audio`` at ``sample_rate`` (24 kHz)."""

    audio: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.audio.shape[0] / self.sample_rate


def tts_ids(tokenizer, text: str, instructions: str | None = None) -> list[int]:
    """The conversation the Talker reads to speak ``text``: a user turn with ``instructions`` (or the
    text itself), then the assistant's turn holding the text."""
    if not isinstance(text, str) or not text.strip():
        raise SpeechInputError("input must be non-empty text", "input")
    user = instructions if instructions else text
    ids = tokenizer.encode_chat([{"role": "user", "content": user}], add_generation_prompt=True)
    return ids + tokenizer.encode(text, add_special_tokens=False)


def answer_ids(prompt_ids: list[int], output_ids: list[int], eos_ids) -> list[int]:
    """A conversation's prompt and the thinker's answer, the answer's end-of-turn token left out."""
    out = list(output_ids)
    while out and out[-1] in eos_ids:
        out.pop()
    return list(prompt_ids) + out


class SpeechPieces:
    """The float32 pieces of one speech as the engine's speech sequence makes them (time-stretched to
    ``speed`` here, on the consumer's side). The sequence is submitted (``submit()``) at the first
    ``next``, so a request waiting for a seat holds no Talker; ``close()``, or dropping it unfinished,
    stops the Talker and frees its sequence."""

    def __init__(self, submit, speed: float = 1.0, sample_rate: int = 24000):
        self._submit = submit
        self._stream = None
        self._tempo = None
        if speed != 1.0:
            from trtedge.runtime.speech.tempo import Tempo

            self._tempo = Tempo(float(speed), sample_rate)
        self._ended = False

    def __iter__(self) -> SpeechPieces:
        return self

    def __next__(self) -> np.ndarray:
        if self._stream is None and not self._ended:
            self._stream = self._submit()
        while not self._ended:
            try:
                delta = next(self._stream)
            except StopIteration:
                self._ended = True
                break
            samples = np.zeros(0, np.float32) if delta.audio is None else delta.audio
            if self._tempo is not None:
                samples = self._tempo.feed(samples)
            if samples.size:
                return samples
        if self._tempo is not None:
            rest, self._tempo = self._tempo.finish(), None
            if rest.size:
                return rest
        raise StopIteration

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            if self._stream is not None:
                self._stream.close()

    def __del__(self) -> None:
        if not self._ended and self._stream is not None:
            self._stream.cancel()


def speak(engine, speech: SpeechPipeline, ids: list[int], options: SpeechOptions) -> SpeechPieces:
    """The speech of ``ids`` (see ``SpeechPipeline.prompt``) as an engine speech sequence, one piece
    per ``codec_chunk_frames`` frames. Refuses (SpeechInputError) now; the Talker starts at the
    first piece asked for."""
    voice = options.voice or speech.default_voice
    speech.check(ids, voice)
    sampling = options.sampling(speech.cfg.frames_per_second)
    return SpeechPieces(
        lambda: engine.submit_speech(ids, voice, sampling, options.codec_chunk_frames),
        options.speed,
        speech.sample_rate,
    )


def load_speech_output(bundle, dtype: str, device: str) -> SpeechPipeline | None:
    """The speech pipeline of a bundle built with its speech components (None otherwise)."""
    if not getattr(bundle, "has_speech", False):
        return None
    import torch

    from trtedge.runtime.models import resolve_device
    from trtedge.runtime.speech.config import SpeechConfig
    from trtedge.runtime.speech.pipeline import THINKER_EMBEDDINGS, load_speech

    cfg = SpeechConfig.from_hf(bundle.config)
    if cfg is None:
        return None
    dev = resolve_device(device)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, torch.float32 if dev.type == "cpu" else torch.bfloat16
    )
    tensors = []
    for name, part in bundle.speech.items():
        tensors += _read(part.weight_files(), lambda n, name=name: speech_tensor_names(n) == name)
    # the thinker's embedding table alone, from the language model's weight files
    table = _read(bundle.weight_files(), lambda n: n in THINKER_EMBEDDINGS)
    if not table:  # quantized (--weights int8 / int4): read whole, then dequantized
        table = [
            (n, t.dequantize() if hasattr(t, "dequantize") else t)
            for n, t in bundle.iter_tensors()
            if n in THINKER_EMBEDDINGS
        ]
    return load_speech(cfg, tensors + table, torch_dtype, dev)


def _read(files, wanted) -> list:
    """(name, tensor) of the ``wanted`` names in safetensors ``files``; the others are not read (a
    component built from the checkpoint's own files lists the whole checkpoint)."""
    from safetensors import safe_open

    out = []
    for file in dict.fromkeys(files):
        with safe_open(str(file), framework="pt") as f:
            out += [(n, f.get_tensor(n)) for n in f.keys() if wanted(n)]
    return out


class LiveSpeech:
    """The speech of an answer the thinker is still generating: ``push`` its token ids as they come,
    ``finish`` at its end (``close`` abandons it); ``pieces()`` (on another thread) yields the
    waveform while the text still arrives. The speech sequence is submitted once
    ``talker_prefill_threshold`` text tokens are there (and the four the Talker's prompt holds); the
    engine's Talker waits whenever it has spoken all the text so far, reading the same rows at the
    same steps as with the whole text."""

    def __init__(
        self, engine, speech: SpeechPipeline, prompt_ids: list[int], options: SpeechOptions, eos_ids
    ):
        import threading

        self.engine, self.speech, self.options = engine, speech, options
        self.voice = options.voice or speech.default_voice
        speech.voice_id(self.voice)
        self.ids = list(prompt_ids)
        self.num_prompt = len(self.ids)
        self.start = speech.answer_start(self.ids)
        self.eos = set(eos_ids)
        self.stream = None
        self.ended = False
        self.cancelled = False
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def push(self, token_ids: list[int]) -> None:
        with self._lock:
            fresh = []
            for t in token_ids:
                if self.ended:
                    break
                if t in self.eos:
                    self._finish()
                    break
                self.ids.append(t)
                if self.stream is None:
                    generated = len(self.ids) - self.num_prompt
                    if len(self.ids) - self.start >= 4 and generated >= self.options.talker_prefill_threshold:
                        self._begin()
                else:
                    fresh.append(t)
            if fresh and self.stream is not None:
                self.stream.push_text(fresh)

    def _begin(self) -> None:
        sampling = self.options.sampling(self.speech.cfg.frames_per_second)
        self.stream = self.engine.submit_speech(
            self.ids, self.voice, sampling, self.options.codec_chunk_frames, live=True
        )
        self._ready.set()

    def finish(self) -> None:
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.stream is None and len(self.ids) - self.start >= 4:
            self._begin()
        if self.stream is not None:
            self.stream.end_text()
        self._ready.set()

    def close(self) -> None:
        """Stop: the Talker's sequence ends at once (the client went away)."""
        with self._lock:
            self.ended = self.cancelled = True
            if self.stream is not None:
                self.stream.cancel()
            self._ready.set()

    def pieces(self) -> Iterator[np.ndarray]:
        self._ready.wait()
        if self.stream is None or self.cancelled:
            return
        for delta in self.stream:
            if delta.audio is not None and delta.audio.size:
                yield delta.audio
