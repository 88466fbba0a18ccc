"""OpenAI request models (pydantic v2, strict types). A validation error becomes a 400 naming the
field (see ``parse_request``). Unknown fields are accepted and logged, as in vLLM; fields whose
features are not served yet are declared so that a request using them is refused, not ignored."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from trtedge.runtime.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS
from trtedge.server.errors import APIError, bad_request
from trtedge.server.logs import name_list
from trtedge.server.openai.structured import GuidedDecoding, ResponseFormat

log = logging.getLogger("trtedge.server")


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A JSON Schema "integer" includes integral numbers written with a fraction (349.0): accept them too.
# (After any Field(...) in an Annotated: constraints before it stay in the JSON schema.)
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]
U64 = Annotated[int, Field(ge=0, le=2**64 - 1), INTEGRAL]
TokenId = Annotated[int, Field(ge=0), INTEGRAL]
MAX_STOP_STRINGS = 16


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ImageURL(_Model):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(_Model):
    url: str
    fps: Annotated[float, Field(gt=0.0, le=60.0)] | None = None  # frames sampled per second (default 2)
    nframes: Annotated[int, Field(ge=1), INTEGRAL] | None = None  # at most this many frames


class InputAudio(_Model):
    data: str  # base64 of the file's bytes
    format: str  # "wav" | "mp3" | "flac" | "ogg" | "m4a" | "webm" (the bytes are sniffed anyway)


class AudioURL(_Model):
    url: str


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: str | ImageURL | None = None
    video_url: str | VideoURL | None = None
    input_audio: InputAudio | None = None
    audio_url: str | AudioURL | None = None


class ChatMessage(_Model):
    # As in OpenAI's reference: a tool message answers one call, named by tool_call_id (the document
    # says so with if/then; the validator refuses one without it, naming messages.N.tool_call_id).
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
        }
    )
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Annotated[str | None, Field(validate_default=True)] = None
    reasoning_content: str | None = None

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id")
        return value


class _Sampling(_Model):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: U64 | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)
        ]
        | None
    ) = None
    n: Annotated[int, Field(ge=1, le=16), INTEGRAL] = 1
    ignore_eos: bool = False
    user: str | None = None
    priority: Int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    reuse_context: bool = True
    cache_generated_tokens: bool | None = None  # unset: true, but false where a hybrid model speculates
    skip_special_tokens: bool = True
    disable_spec_decode: bool = False  # generate without speculative decoding (when the server has it)
    # vLLM's: the logprob of every prompt token (and this many top alternatives), computed in the prefill
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    # Requests with different salts never share cached prefixes (tenant isolation of context reuse).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Structured output (at most one of these; see structured.py)
    response_format: ResponseFormat | None = None
    guided_decoding: GuidedDecoding | None = None
    structured_outputs: GuidedDecoding | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class TalkerFields(_Model):
    """The reference's Talker fields: its sampling, the audio's length cap, the Code2Wav chunk and how
    many text tokens the Talker waits for (speech requests and a chat's ``audio``)."""

    talker_temperature: float | None = None
    talker_top_k: Int | None = None
    talker_top_p: float | None = None
    repetition_penalty: float | None = None  # the Talker's
    max_audio_length: float | None = None
    codec_chunk_frames: Int | None = None
    talker_prefill_threshold: Int | None = None


class ChatAudio(TalkerFields):
    """``audio`` of a chat request with ``modalities: ["text", "audio"]``: the voice, the format, and the
    Talker's sampling (its ``repetition_penalty`` here: the top-level one is the text's)."""

    voice: str | None = None
    format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"]


class ChatCompletionRequest(_Sampling):
    # Where each media part came from in the client's own request (set by the Anthropic and Responses
    # translations): (message, part) -> the param that errors about that part name.
    _media_params: dict[tuple[int, int], str] = PrivateAttr(default_factory=dict)
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    apply_chat_template: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # speech output (a model with a Talker): modalities ["text", "audio"] and the audio's voice and format;
    # the reference's Talker fields may also come at the top level
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudio | None = None
    talker_temperature: float | None = None
    talker_top_k: Int | None = None
    talker_top_p: float | None = None
    max_audio_length: float | None = None
    codec_chunk_frames: Int | None = None
    talker_prefill_threshold: Int | None = None


class CompletionRequest(_Sampling):
    # 0: the prompt is scored only (echo with logprobs, prompt_logprobs), nothing is generated
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    # "" (or an empty token list inside a list) is served from the start of a document, as OpenAI does
    prompt: (
        str
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[list[TokenId]], Field(min_length=1)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1), INTEGRAL] | None = None


Request = TypeVar("Request", bound=_Model)


def parse_request(body: bytes, model: type[Request]) -> Request:
    """Decode and validate a JSON body; any problem is a 400 whose ``param`` names the field."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _field_error(e) from None
    if request.model_extra:
        log.info("ignoring unknown request field(s): %s", name_list(request.model_extra))
    return request


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _field_error(error: ValidationError) -> APIError:
    errors = error.errors(include_url=False)
    # The most specific branch of a union; among equals, a broken constraint over a wrong type.
    first = max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    # Drop union-branch names pydantic adds to the location (e.g. "str", "list[...]").
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or not _is_type_name(str(p))]
    param = ".".join(loc) if loc else None
    message = first["msg"]
    if first["type"] == "missing":
        message = "field required"
    return bad_request(f"{param or 'body'}: {message}", param=param, code="invalid_value")


def _is_type_name(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "dict", "list", "none")
        or part.startswith(("list[", "dict[", "function-", "constrained-", "literal["))
        or "[" in part
        or (part[:1].isupper() and part.isalnum())  # a model in a union (ImageURL, ...)
    )
