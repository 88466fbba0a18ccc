"""POST /v1/audio/transcriptions: OpenAI's multipart contract over an ASR model (Qwen3-ASR, or an
RNN-T transcriber such as Nemotron-3.5-ASR: no prompt, greedy only, its own language codes).

Fields: ``file`` (required), ``model``, ``language`` (ISO-639-1), ``prompt`` (context for the model:
names, spellings), ``response_format`` (json | text; verbose_json, srt and vtt need segment times,
which these models do not emit: 400), ``temperature`` (0..1, default 0), ``stream`` (server-sent
``transcript.text.delta`` events, then ``transcript.text.done``). Every refusal comes before the
request takes an admission seat; the answer goes through the same seats, auth and metrics as chat.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from trtedge.llm import PromptTooLongError
from trtedge.runtime.multimodal import MultimodalPrompt
from trtedge.runtime.multimodal.transcription import (
    TranscriptionPrompt,
    TranscriptReader,
    language_name,
    transcription_prompt,
)
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.server import sse
from trtedge.server.audio import decode_audio, require_av
from trtedge.server.core import ServingCore, closer, stream_error
from trtedge.server.errors import APIError, bad_request
from trtedge.server.generation import Choice
from trtedge.server.multimodal import in_media_thread
from trtedge.server.multipart import Upload, parse_form

FORM_SLACK = 1 << 20  # bytes of a form besides its file (field values, part headers)
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
NO_AUDIO = "this model has no audio component; it cannot transcribe (serve an ASR model such as Qwen3-ASR)"
_IGNORED = (
    "timestamp_granularities[]",
    "timestamp_granularities",
    "include[]",
    "include",
    "chunking_strategy",
)
_FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream") + _IGNORED


@dataclass(frozen=True)
class TranscriptionForm:
    file: Upload
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    stream: bool = False
    priority: int = 0  # what the admission queue orders by (the form has no field for it)

    @classmethod
    def parse(cls, fields: list[tuple[str, str | Upload]]) -> TranscriptionForm:
        values: dict[str, str | Upload] = {}
        for name, value in fields:
            if name not in _FIELDS:
                raise bad_request(f"unknown field {name!r}", param=name, code="unknown_field")
            if name in _IGNORED:
                continue
            if name in values:
                raise bad_request(f"field {name!r} is given twice", param=name, code="invalid_value")
            if (name == "file") != isinstance(value, Upload):
                what = "a file upload" if name == "file" else "a text field"
                raise bad_request(f"{name!r} must be {what}", param=name, code="invalid_value")
            values[name] = value
        upload = values.pop("file", None)
        if upload is None:
            raise bad_request(
                "the form needs a 'file' (the audio to transcribe)", param="file", code="missing"
            )
        text: dict[str, str] = {k: v for k, v in values.items() if isinstance(v, str)}
        fmt = text.get("response_format") or "json"
        if fmt not in RESPONSE_FORMATS:
            raise bad_request(
                f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r}",
                param="response_format",
                code="invalid_value",
            )
        if fmt not in ("json", "text"):
            raise bad_request(
                f"response_format {fmt} needs segment timestamps, which this model does not emit; use json or text",
                param="response_format",
                code="unsupported_value",
            )
        return cls(
            file=upload,  # type: ignore[arg-type]
            model=text.get("model") or None,
            language=text.get("language") or None,  # checked against the model's languages later
            prompt=text.get("prompt") or None,
            response_format=fmt,
            temperature=_temperature(text.get("temperature")),
            stream=_boolean(text.get("stream"), "stream"),
        )


def _language(value: str | None) -> str | None:
    if not value:
        return None
    try:
        language_name(value)
    except ValueError as e:
        raise bad_request(str(e), param="language", code="invalid_value") from None
    return value


def _temperature(value: str | None) -> float:
    if value is None or value == "":
        return 0.0
    try:
        t = float(value)
    except ValueError:
        t = float("nan")
    if not 0.0 <= t <= 1.0:
        raise bad_request(f"temperature must be a number in [0, 1], got {value!r}", param="temperature")
    return t


def _boolean(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise bad_request(f"{name} must be true or false, got {value!r}", param=name)


async def transcribe(serving: ServingCore, request: Request, body: bytes) -> Response:
    """The route's work once the body (at most ``max_audio_bytes`` + FORM_SLACK) has arrived."""
    arrival = time.monotonic()
    config, llm = serving.config, serving.llm
    form = TranscriptionForm.parse(
        await in_media_thread(parse_form, request.headers.get("content-type"), body)
    )
    del body
    serving.check_model(form.model)
    if llm.audio is None:
        raise bad_request(NO_AUDIO, param="file", code="no_audio_component")
    transducer = llm.audio.transcription == "transducer"
    if transducer:
        _check_transducer_form(form, llm.audio)
    else:
        _language(form.language)
    size = len(form.file.data)
    if size > config.max_audio_bytes:
        raise APIError(
            413,
            f"the audio file is {size} bytes; the limit is --max-audio-bytes {config.max_audio_bytes}",
            param="file",
            code="audio_too_large",
        )
    require_av()
    samples = await in_media_thread(
        decode_audio, form.file.data, "file", config.max_audio_seconds, llm.audio.sampling_rate
    )
    if transducer:
        prompt, header = await in_media_thread(_transducer_prompt, llm.audio, samples, form.language), False
    else:
        tp = transcription_prompt(samples, form.prompt, form.language, llm.audio.transcription)
        prompt, header = await in_media_thread(_encode, serving, tp), tp.header
    num_audio = sum(it.num_tokens for it in prompt.items)
    params = _params(serving, len(prompt.ids), form.temperature)
    rid = f"trsc-{uuid.uuid4().hex}"
    started = await serving.start(form, [Choice(prompt, params)], rid, request, arrival)
    if started is None:
        return Response(status_code=499)
    gen, watcher = started
    reader = TranscriptReader(header_done=not header)
    if form.stream:
        return sse.SSEResponse(_events(gen, reader, num_audio), on_close=closer(gen, watcher))
    [out] = await serving.collect(gen, watcher)
    reader.feed("".join(out.text))
    reader.finish()
    text = reader.text.strip()
    if form.response_format == "text":
        return PlainTextResponse(text + "\n")
    return JSONResponse({"text": text, "usage": _usage(out.prompt_tokens, out.completion_tokens, num_audio)})


def transcription_only(llm) -> bool:
    """Whether ``llm`` is an RNN-T transcriber: it serves transcriptions and nothing else."""
    return llm.audio is not None and llm.audio.transcription == "transducer"


def refuse_generation(model_name: str):
    """The handler of a generation route on a transcriber: 400 naming the one route it serves."""

    async def refuse(request: Request) -> Response:
        raise bad_request(
            f"{model_name} is an RNN-T transcriber: it serves only POST /v1/audio/transcriptions",
            param="model",
            code="transcription_only",
        )

    return refuse


def _check_transducer_form(form: TranscriptionForm, audio) -> None:
    """An RNN-T transcriber decodes greedily from the audio alone: no prompt, no sampling."""
    if form.prompt:
        raise bad_request(
            "this model (an RNN-T transcriber) takes no prompt; leave it out",
            param="prompt",
            code="unsupported_value",
        )
    if form.temperature:
        raise bad_request(
            "this model (an RNN-T transcriber) decodes greedily; leave temperature out or send 0",
            param="temperature",
            code="unsupported_value",
        )
    if form.language is not None:
        try:
            audio.prompt_id(form.language)
        except ValueError as e:
            raise bad_request(str(e), param="language", code="invalid_value") from None


def _transducer_prompt(audio, samples, language: str | None) -> MultimodalPrompt:
    try:
        return audio.prompt(samples, language)
    except ValueError as e:
        raise bad_request(str(e), param="file", code="invalid_audio") from None


def _encode(serving: ServingCore, tp: TranscriptionPrompt) -> MultimodalPrompt:
    llm = serving.llm
    try:
        prompt = llm.encode_prompt(tp.messages)
    except ValueError as e:
        raise bad_request(str(e), param="file", code="invalid_audio") from None
    if not tp.prefill:
        return prompt
    extra = llm.tokenize(tp.prefill, add_special_tokens=False)
    positions = prompt.positions
    if positions is not None:  # M-RoPE: text after the media counts up from the largest position
        positions = torch.cat([positions, (torch.arange(len(extra)) + positions.max() + 1).expand(3, -1)], 1)
    return dataclasses.replace(prompt, ids=prompt.ids + extra, positions=positions)


def _params(serving: ServingCore, num_prompt_tokens: int, temperature: float) -> SamplingParams:
    llm = serving.llm
    capacity = llm.config.max_kv_cache_capacity
    max_tokens = max(capacity - num_prompt_tokens, 1)
    max_tokens = min(max_tokens, serving.config.generation_defaults.get("max_new_tokens", max_tokens))
    try:
        llm.check_lengths(num_prompt_tokens, max_tokens)
    except PromptTooLongError as e:
        raise bad_request(str(e), param="file", code="context_length_exceeded") from None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature)


def _usage(prompt_tokens: int, output_tokens: int, audio_tokens: int) -> dict:
    return {
        "type": "tokens",
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
        "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": prompt_tokens - audio_tokens},
    }


async def _events(gen, reader: TranscriptReader, num_audio: int) -> AsyncIterator[bytes]:
    prompt_tokens = completion = 0
    try:
        async for _, d in gen.deltas():
            if gen.cancelled:
                return
            text = reader.feed(d.text)
            if text:
                yield sse.event({"type": "transcript.text.delta", "delta": text})
            prompt_tokens, completion = d.prompt_tokens, d.completion_tokens
        rest = reader.finish()
        if rest:
            yield sse.event({"type": "transcript.text.delta", "delta": rest})
        done = {"type": "transcript.text.done", "text": reader.text.strip()}
        yield sse.event({**done, "usage": _usage(prompt_tokens, completion, num_audio)})
    except Exception as e:
        if gen.cancelled:
            return
        yield sse.event(stream_error(e), name="error")
    yield sse.DONE
