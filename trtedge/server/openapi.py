"""The OpenAPI 3.1 document of `trtedge serve`, generated from the pydantic request models (the
schemas the server validates with), served at GET /openapi.json."""

from __future__ import annotations

from pydantic import BaseModel

from trtedge._version import __version__
from trtedge.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from trtedge.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from trtedge.server.openai.speech import SpeechRequest
from trtedge.server.openai.tokenization import DetokenizeRequest, TokenizeRequest
from trtedge.server.responses.protocol import ResponsesRequest

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


# POST /v1/audio/transcriptions takes a multipart/form-data upload (server/openai/transcription.py parses it).
_TRANSCRIPTION_FORM = {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {
            "type": "string",
            "contentMediaType": "application/octet-stream",
            "description": "the audio file: wav, flac, mp3, ogg (Opus / Vorbis), m4a or webm",
        },
        "model": {"type": "string", "description": "the served model's id (optional)"},
        "language": {
            "type": "string",
            "description": "ISO-639-1 code (en, de, zh, ...) or the language's name",
        },
        "prompt": {"type": "string", "description": "context for the model: names, spellings, hot words"},
        "response_format": {"enum": ["json", "text"], "default": "json"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1, "default": 0},
        "stream": {"type": "boolean", "default": False},
    },
    "additionalProperties": False,
}


def _errors(*statuses: int, shape: str = "Error") -> dict:
    reasons = {
        400: "invalid request (param names the field)",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "body too large",
        429: "overloaded (Retry-After says when to retry)",
        500: "internal error",
        503: "engine failed or shutting down",
        529: "overloaded_error: the queue is full (Retry-After says when to retry)",
    }
    content = {"application/json": {"schema": {"$ref": _REF.format(model=shape)}}}
    return {str(s): {"description": reasons[s], "content": content} for s in statuses}


def _post(model: type[BaseModel], summary: str, errors: dict | None = None, stream: str = "") -> dict:
    json_or_sse = {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {
            "schema": {"type": "string", "description": stream or "SSE chunks, then data: [DONE]"}
        },
    }
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {"apiKey": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
            },
            "responses": {
                "200": {
                    "description": "the completion, or a stream when stream is true",
                    "content": json_or_sse,
                },
                **(errors or _errors(400, 401, 404, 413, 429, 500, 503)),
            },
        }
    }


def _get(summary: str, content_type: str = "application/json", secured: bool = False) -> dict:
    op: dict = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {content_type: {"schema": {"type": "object"}}}}
        },
    }
    if secured:
        op["security"] = [{"bearer": []}, {"apiKey": []}]
        op["responses"].update(_errors(401, 404))
    return {"get": op}


def openapi_schema(api_key: bool = True) -> dict:
    """The document; ``api_key``: the server checks an API key on /v1 (else no security is declared)."""
    document = _document()
    if not api_key:
        del document["components"]["securitySchemes"]
        for item in document["paths"].values():
            for op in item.values():
                if isinstance(op, dict):
                    op.pop("security", None)
                    op.get("responses", {}).pop("401", None)
    return document


def _document() -> dict:
    schemas: dict = {
        "Error": _ERROR,
        "AnthropicError": _ANTHROPIC_ERROR,
        "TranscriptionForm": _TRANSCRIPTION_FORM,
    }
    for model in (
        ChatCompletionRequest,
        CompletionRequest,
        ResponsesRequest,
        MessagesRequest,
        CountTokensRequest,
        TokenizeRequest,
        DetokenizeRequest,
        SpeechRequest,
    ):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": "trtedge serve", "version": __version__},
        "paths": {
            "/health": _get("Status, limits, capabilities; 503 once the engine has failed"),
            "/health/ready": _get("Ready to take requests (503 otherwise)"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/v1/models": _get("The served model", secured=True),
            "/v1/models/{model_id}": {
                **_get("One model by id", secured=True),
                "parameters": [
                    {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
            },
            "/v1/chat/completions": _post(ChatCompletionRequest, "OpenAI chat completions"),
            "/v1/completions": _post(CompletionRequest, "OpenAI completions"),
            "/v1/responses": _post(
                ResponsesRequest,
                "OpenAI Responses (not stored: previous_response_id is refused)",
                stream="Responses events: response.created, response.output_item.added, response.output_text.delta, "
                "response.function_call_arguments.delta, response.output_item.done, response.completed",
            ),
            "/v1/messages": _post(
                MessagesRequest,
                "Anthropic Messages",
                _errors(400, 401, 404, 413, 500, 503, 529, shape="AnthropicError"),
                "Anthropic events: message_start, content_block_start/delta/stop, ping, message_delta, "
                "message_stop",
            ),
            "/v1/messages/count_tokens": _post(
                CountTokensRequest,
                "Anthropic token count",
                _errors(400, 401, 404, 413, shape="AnthropicError"),
            ),
            "/v1/audio/speech": {
                "post": {
                    "summary": "OpenAI text to speech (a model with speech output, e.g. Qwen3-Omni)",
                    "security": [{"bearer": []}, {"apiKey": []}],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": _REF.format(model="SpeechRequest")}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "the audio in response_format, streamed as it is made; "
                            "speech.audio.delta events when stream_format is sse",
                            "content": {
                                "audio/pcm": {"schema": {"type": "string", "format": "binary"}},
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        **_errors(400, 401, 404, 413, 429, 500, 503),
                    },
                }
            },
            "/v1/voices": _get("the voices of a model with speech output", secured=True),
            "/tokenize": _post(
                TokenizeRequest,
                "vLLM tokenize: a prompt or messages -> token ids",
                _errors(400, 401, 404, 413),
            ),
            "/detokenize": _post(
                DetokenizeRequest, "vLLM detokenize: token ids -> text", _errors(400, 401, 404, 413)
            ),
            "/v1/audio/transcriptions": {
                "post": {
                    "summary": "OpenAI audio transcription (a model with an audio component, e.g. Qwen3-ASR)",
                    "security": [{"bearer": []}, {"apiKey": []}],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "multipart/form-data": {
                                "schema": {"$ref": _REF.format(model="TranscriptionForm")}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "the transcript; a stream when stream is true",
                            "content": {
                                "application/json": {"schema": {"type": "object"}},
                                "text/plain": {"schema": {"type": "string"}},
                                "text/event-stream": {
                                    "schema": {
                                        "type": "string",
                                        "description": "transcript.text.delta events, then transcript.text.done",
                                    }
                                },
                            },
                        },
                        **_errors(400, 401, 404, 413, 429, 500, 503),
                    },
                }
            },
            "/tokenizer_info": _get("vLLM tokenizer info: special tokens, chat template", secured=True),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }
