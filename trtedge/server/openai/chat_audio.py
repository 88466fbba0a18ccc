"""Chat completions with speech output: ``modalities: ["text", "audio"]`` and ``audio: {"voice",
"format"}`` on a model with a Talker (Qwen3-Omni). The engine generates the text; the Talker speaks the
answer (prompt and generated ids): streamed, while the text is still generated (``LiveAudio``), else
once it is complete; the request's seat is held until the audio is sent.

As OpenAI's API: the answer's text is ``message.audio.transcript`` (``content`` is null) and the audio is
``message.audio.data`` (base64 in ``format``) with an ``id`` and ``expires_at``; streamed, the text comes
as ``delta.audio.transcript`` pieces and the audio as ``delta.audio.data`` pieces as they are made, then
the finish."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trtedge.runtime.speech.api import NO_SPEECH, SpeechOptions, answer_ids
from trtedge.runtime.speech.pipeline import SpeechInputError
from trtedge.server import sse
from trtedge.server.errors import bad_request

if TYPE_CHECKING:
    from trtedge.server.openai.protocol import ChatCompletionRequest

EXPIRY_SECONDS = 3600  # how long a client may refer to the answer's audio id (nothing is kept: informative)
_TOP = ("talker_temperature", "talker_top_k", "talker_top_p", "max_audio_length", "codec_chunk_frames")
_TOP += ("talker_prefill_threshold",)
_AUDIO = _TOP + ("repetition_penalty",)


@dataclass(frozen=True)
class AudioPlan:
    options: SpeechOptions
    format: str  # the encoder's: pcm for pcm16
    id: str

    def audio_object(self, data: bytes | None, transcript: str | None) -> dict:
        out: dict = {"id": self.id, "expires_at": int(time.time()) + EXPIRY_SECONDS}
        if data is not None:
            out["data"] = base64.b64encode(data).decode()
        if transcript is not None:
            out["transcript"] = transcript
        return out


def plan_audio(llm, req: ChatCompletionRequest) -> AudioPlan | None:
    """None for a text-only request; a 400 naming the field for one speech output cannot serve."""
    modalities = req.modalities or ["text"]
    if "audio" not in modalities:
        if req.audio is not None:
            raise bad_request('audio needs modalities ["text", "audio"]', "modalities")
        return None
    if llm.speech_output is None:
        raise bad_request(f"{NO_SPEECH}: modalities cannot include audio", "modalities", "no_speech_output")
    if req.audio is None:
        raise bad_request('modalities ["text", "audio"] needs audio: {"voice": ..., "format": ...}', "audio")
    if req.n != 1:
        raise bad_request("audio output is made for one choice: n must be 1", "n")
    values = {k: getattr(req, k) for k in _TOP if getattr(req, k) is not None}
    nested = {k: getattr(req.audio, k) for k in _AUDIO if getattr(req.audio, k) is not None}
    try:
        options = SpeechOptions(**values, **nested, voice=req.audio.voice, seed=req.seed)
        if options.voice is not None:
            llm.speech_output.voice_id(options.voice)
    except SpeechInputError as e:
        param = e.param if e.param in values else f"audio.{e.param}"
        raise bad_request(str(e), param) from None
    fmt = "pcm" if req.audio.format == "pcm16" else req.audio.format
    return AudioPlan(options, fmt, f"audio_{uuid.uuid4().hex}")


def check_prompt(plan) -> None:
    """Media in the conversation cannot be spoken (the Talker would need the thinker's hidden states)."""
    if hasattr(plan.choices[0].prompt, "items"):
        raise bad_request(
            "audio output from a prompt with audio, image or video input is not supported yet; send text only",
            "modalities",
        )


async def speak(llm, audio: AudioPlan, prompt_ids: list[int], output_ids: list[int]) -> AsyncIterator[bytes]:
    """The answer's audio in ``audio.format``, piece by piece, the Talker on a worker thread."""
    from trtedge.runtime.speech.encode import Encoder

    ids = answer_ids(prompt_ids, output_ids, set(llm.tokenizer_info().eos_token_ids))
    loop = asyncio.get_running_loop()
    stream = llm.speech_stream(token_ids=ids, **_kwargs(audio.options))
    encoder = Encoder(audio.format, llm.speech_output.sample_rate)
    try:
        while True:
            piece = await loop.run_in_executor(None, next, stream, None)
            if piece is None:
                break
            data = encoder.feed(piece)
            if data:
                yield data
        rest = encoder.finish()
        if rest:
            yield rest
    finally:
        stream.close()
        encoder.close()


def _kwargs(options: SpeechOptions) -> dict:
    return {k: getattr(options, k) for k in SpeechOptions.__dataclass_fields__}


async def whole(llm, audio: AudioPlan, prompt_ids: list[int], output_ids: list[int]) -> bytes:
    return b"".join([piece async for piece in speak(llm, audio, prompt_ids, output_ids)])


def audio_chunk(head: dict, audio: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"audio": audio}, "logprobs": None, "finish_reason": finish}
    return sse.event({**head, "choices": [choice]})


class LiveAudio:
    """A streamed chat's audio made while its text streams: ``push`` each delta's token ids,
    ``ready()`` the encoded audio made so far, ``rest()`` the remainder once the text is complete;
    ``close()`` stops the Talker (the client left). The Talker runs on a worker thread."""

    def __init__(self, llm, audio: AudioPlan, prompt_ids: list[int]):
        from trtedge.runtime.speech.encode import Encoder

        self.speech = llm.speech_live(prompt_ids, **_kwargs(audio.options))
        self.encoder = Encoder(audio.format, llm.speech_output.sample_rate)
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.task = loop.run_in_executor(None, self._run, loop)

    def _run(self, loop) -> None:
        try:
            for piece in self.speech.pieces():
                loop.call_soon_threadsafe(self.queue.put_nowait, piece)
        except BaseException as e:  # noqa: BLE001 - handed to the stream, which reports it
            loop.call_soon_threadsafe(self.queue.put_nowait, e)
        finally:
            loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def push(self, token_ids: list[int]) -> None:
        self.speech.push(token_ids)

    def _encode(self, item) -> bytes:
        if isinstance(item, BaseException):
            raise item
        return self.encoder.feed(item)

    def ready(self) -> list[bytes]:
        out = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is None:
                self.queue.put_nowait(None)  # the end stays for rest()
                break
            data = self._encode(item)
            if data:
                out.append(data)
        return out

    async def rest(self) -> AsyncIterator[bytes]:
        self.speech.finish()
        while (item := await self.queue.get()) is not None:
            data = self._encode(item)
            if data:
                yield data
        data = self.encoder.finish()
        if data:
            yield data

    def close(self) -> None:
        self.speech.close()
        self.encoder.close()
