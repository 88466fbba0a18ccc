"""POST /v1/audio/speech and GET /v1/voices: OpenAI's text-to-speech contract over a model with speech
output (Qwen3-Omni's Talker, code predictor and Code2Wav).

Fields: ``input`` (required, at most 4096 characters and --max-input-len tokens), ``voice`` (one of
GET /v1/voices; default the model's first, Ethan for Qwen3-Omni), ``model``, ``instructions`` (the
user turn the Talker reads before the text), ``response_format`` (pcm: 24 kHz mono signed 16-bit
little-endian, the default; wav, mp3, opus, aac, flac), ``speed`` (0.25 to 4, the pitch kept),
``stream_format`` (audio:
the bytes as they are made; sse: ``speech.audio.delta`` events with base64 audio, then
``speech.audio.done``), and the reference's ``talker_temperature``, ``talker_top_k``, ``talker_top_p``,
``repetition_penalty``, ``max_audio_length``, ``codec_chunk_frames``, ``talker_prefill_threshold`` and
``seed``. Every refusal comes before the request takes an admission seat; the seat is held until the
last byte is sent or the client leaves."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trtedge.runtime.speech.api import NO_SPEECH
from trtedge.runtime.speech.pipeline import SpeechInputError
from trtedge.server import sse
from trtedge.server.errors import bad_request
from trtedge.server.openai.protocol import U64, Int, TalkerFields

if TYPE_CHECKING:
    from trtedge.server.core import ServingCore

MAX_INPUT_CHARS = 4096
_OPTIONS = (
    "talker_temperature",
    "talker_top_k",
    "talker_top_p",
    "repetition_penalty",
    "max_audio_length",
    "codec_chunk_frames",
    "talker_prefill_threshold",
    "seed",
)


class SpeechRequest(TalkerFields):
    input: str
    model: str | None = None
    voice: str | None = None
    instructions: str | None = None
    response_format: Literal["pcm", "wav", "mp3", "opus", "aac", "flac"] = "pcm"
    speed: Annotated[float, Field(ge=0.25, le=4.0)] = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    seed: U64 | None = None
    priority: Int = 0


def voices(serving: ServingCore) -> Response:
    llm = serving.llm
    speech = llm.speech_output
    names = llm.voices
    default = None if speech is None else speech.default_voice
    data = [{"id": n, "name": n.capitalize(), "object": "voice", "default": n == default} for n in names]
    return JSONResponse({"object": "list", "data": data})


def _check(serving: ServingCore, req: SpeechRequest) -> Iterator:
    """The waveform stream of ``req``, or a 400 naming the field; nothing is made yet."""
    llm = serving.llm
    serving.check_model(req.model)
    if llm.speech_output is None:
        raise bad_request(
            f"{NO_SPEECH}; serve a Qwen3-Omni checkpoint built with --components all",
            "model",
            "no_speech_output",
        )
    if not req.input.strip():
        raise bad_request("input must be non-empty text", "input")
    if len(req.input) > MAX_INPUT_CHARS:
        raise bad_request(
            f"input has {len(req.input)} characters; the limit is {MAX_INPUT_CHARS}",
            "input",
            "input_too_long",
        )
    options = {k: getattr(req, k) for k in _OPTIONS if getattr(req, k) is not None}
    if req.speed != 1.0:
        options["speed"] = req.speed
    try:
        stream = llm.speech_stream(req.input, voice=req.voice, instructions=req.instructions, **options)
    except SpeechInputError as e:
        raise bad_request(str(e), e.param) from None
    return stream


async def speech(serving: ServingCore, req: SpeechRequest, request: Request) -> Response:
    from trtedge.runtime.speech.encode import MEDIA_TYPES, Encoder

    arrival = time.monotonic()
    llm = serving.llm
    stream = _check(serving, req)
    num_tokens = llm.speech_input_tokens(req.input, req.instructions)
    encoder = Encoder(req.response_format, llm.speech_output.sample_rate)
    watcher = sse.DisconnectWatcher(request.receive)
    try:
        seat = await serving.admission.acquire(req.priority, abort=watcher.gone)
    except asyncio.CancelledError:
        watcher.stop()
        encoder.close()
        if watcher.gone.is_set():
            return Response(status_code=499)
        raise
    except BaseException:
        watcher.stop()
        encoder.close()
        raise
    serving.metrics.queue_time.observe(time.monotonic() - arrival)

    def close() -> None:
        watcher.stop()
        encoder.close()
        seat.release()

    body = _audio(stream, encoder, watcher)
    if req.stream_format == "sse":
        return sse.SSEResponse(_events(body, num_tokens), on_close=close)
    return sse.SSEResponse(body, on_close=close, media_type=MEDIA_TYPES[req.response_format])


async def _audio(stream: Iterator, encoder, watcher: sse.DisconnectWatcher) -> AsyncIterator[bytes]:
    """The encoded audio as Code2Wav makes it (the Talker runs on a worker thread)."""
    loop = asyncio.get_running_loop()
    try:
        while not watcher.gone.is_set():
            piece = await loop.run_in_executor(None, next, stream, None)
            if piece is None:
                break
            data = encoder.feed(piece)
            if data:
                yield data
        if watcher.gone.is_set():
            return
        rest = encoder.finish()
        if rest:
            yield rest
    finally:
        stream.close()  # the client went away: the Talker's sequence stops now


async def _events(body: AsyncIterator[bytes], num_tokens: int) -> AsyncIterator[bytes]:
    async for data in body:
        yield sse.event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    usage = {"input_tokens": num_tokens, "output_tokens": 0, "total_tokens": num_tokens}
    yield sse.event({"type": "speech.audio.done", "usage": usage})
