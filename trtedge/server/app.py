"""The starlette app: routes kept thin; the work is in core.py (the pipeline) and each API's serving module."""

from __future__ import annotations

import asyncio
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from trtedge.llm import LLM, structured_output_available
from trtedge.server import logs
from trtedge.server.admission import Admission
from trtedge.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from trtedge.server.anthropic.serving import AnthropicServing, anthropic_error
from trtedge.server.auth import APIKeyMiddleware
from trtedge.server.config import BODY_TIMEOUT, ServeConfig
from trtedge.server.core import ServingCore
from trtedge.server.errors import APIError, engine_unavailable, internal_error, redact
from trtedge.server.metrics import ServerMetrics
from trtedge.server.openai.chat import ChatServing
from trtedge.server.openai.completions import CompletionServing
from trtedge.server.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from trtedge.server.openai.speech import SpeechRequest, speech, voices
from trtedge.server.openai.tokenization import DetokenizeRequest, TokenizationServing, TokenizeRequest
from trtedge.server.openai.transcription import (
    FORM_SLACK,
    refuse_generation,
    transcribe,
    transcription_only,
)
from trtedge.server.openapi import openapi_schema
from trtedge.server.responses.protocol import ResponsesRequest
from trtedge.server.responses.serving import ResponsesServing

log = logging.getLogger("trtedge.server")

ENDPOINTS = (
    "/",
    "/health",
    "/health/ready",
    "/metrics",
    "/openapi.json",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/audio/transcriptions",
    "/v1/audio/speech",
    "/v1/voices",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)


def build_app(llm: LLM, config: ServeConfig | None = None) -> Starlette:
    """An ASGI app serving ``llm``. The caller owns the LLM (and closes it after the server stops)."""
    config = config or ServeConfig()
    logs.install()
    launch = llm.config
    admission = Admission.for_engine(
        launch.enable_in_flight_batching,
        launch.max_batch_size,
        config.max_queued_requests,
        config.queue_timeout,
    )
    metrics = ServerMetrics(
        llm.stats,
        lambda: admission.num_waiting,
        lambda: admission.num_active,
        llm.get_context_cache_metrics,
        llm.get_profiling_metrics,
    )
    serving = ServingCore(llm, config, admission, metrics)
    chat_serving, completion_serving = ChatServing(serving), CompletionServing(serving)
    anthropic = AnthropicServing(serving)
    responses = ResponsesServing(serving)
    tokenization = TokenizationServing(serving)

    async def health(request: Request) -> Response:
        body = health_body(llm, config, admission, serving.model_name)
        return JSONResponse(body, status_code=503 if body["status"] != "ok" else 200)

    async def root(request: Request) -> Response:
        # clients (Claude Code) probe the base URL before their first request
        return PlainTextResponse(f"trtedge serve: {serving.model_name}\n")

    async def ready(request: Request) -> Response:
        error = llm.stats()["engine_error"]
        if error is not None or admission.draining:
            reason = redact(f"engine failed: {error}") if error else "shutting down"
            return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    schema = openapi_schema(api_key=bool(config.api_key or config.api_keys))

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [serving.model_card()]})

    async def model(request: Request) -> Response:
        serving.check_model(request.path_params["model_id"])
        return JSONResponse(serving.model_card())

    async def chat(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), ChatCompletionRequest)
        return await chat_serving.create(body, request)

    async def completions(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), CompletionRequest)
        return await completion_serving.create(body, request)

    async def messages(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), MessagesRequest)
        return await anthropic.messages(body, request)

    async def count_tokens(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), CountTokensRequest)
        return await anthropic.count_tokens(body)

    async def create_response(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), ResponsesRequest)
        return await responses.create(body, request)

    async def transcriptions(request: Request) -> Response:
        body = await read_body(request, config.max_audio_bytes + FORM_SLACK)
        return await transcribe(serving, request, body)

    async def create_speech(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), SpeechRequest)
        return await speech(serving, body, request)

    async def list_voices(request: Request) -> Response:
        return voices(serving)

    async def tokenize(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), TokenizeRequest)
        return await tokenization.tokenize(body)

    async def detokenize(request: Request) -> Response:
        body = parse_request(await read_body(request, config.max_body_bytes), DetokenizeRequest)
        return await tokenization.detokenize(body)

    async def tokenizer_info(request: Request) -> Response:
        return tokenization.tokenizer_info()

    if transcription_only(llm):  # an RNN-T transcriber has nothing to chat or complete with
        chat = completions = messages = count_tokens = create_response = refuse_generation(serving.model_name)

    routes = [
        Route("/", _guard(root), methods=["GET", "HEAD"]),
        Route("/health", _guard(health)),
        Route("/health/ready", _guard(ready)),
        Route("/metrics", _guard(metrics_route)),
        Route("/openapi.json", _guard(openapi)),
        Route("/v1/models", _guard(models)),
        Route("/v1/models/{model_id:path}", _guard(model)),
        Route("/v1/chat/completions", _guard(chat), methods=["POST"]),
        Route("/v1/completions", _guard(completions), methods=["POST"]),
        Route("/v1/messages", _guard(messages, anthropic_error), methods=["POST"]),
        Route("/v1/messages/count_tokens", _guard(count_tokens, anthropic_error), methods=["POST"]),
        Route("/v1/responses", _guard(create_response), methods=["POST"]),
        Route("/v1/audio/transcriptions", _guard(transcriptions), methods=["POST"]),
        Route("/v1/audio/speech", _guard(create_speech), methods=["POST"]),
        Route("/v1/voices", _guard(list_voices)),
        Route("/tokenize", _guard(tokenize), methods=["POST"]),
        Route("/detokenize", _guard(detokenize), methods=["POST"]),
        Route("/tokenizer_info", _guard(tokenizer_info)),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.admission = admission
    app.state.serving = serving
    app.state.anthropic = anthropic
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key, tenants=config.api_keys)
    app.add_middleware(_CountRequests, metrics=metrics)
    return app


def health_body(llm: LLM, config: ServeConfig, admission: Admission, model_name: str) -> dict:
    stats = llm.stats()
    launch = llm.config
    ifb = launch.enable_in_flight_batching
    body: dict = {
        "status": "ok" if stats["engine_error"] is None else "error",
        "model": model_name,
        "active_requests": max(0, admission.num_active - (stats["waiting"] if ifb else 0)),
        "queued_requests": admission.num_waiting + (stats["waiting"] if ifb else 0),
        "capabilities": {
            "max_model_len": launch.max_kv_cache_capacity,
            "max_input_len": launch.max_input_len,
            "max_batch_size": launch.max_batch_size if ifb else 1,
            "in_flight_batching": ifb,
            "context_reuse": launch.context_cache.enabled,
            "speculative": stats["speculative"],
            "structured_output": structured_output_available(),
            "vision": llm.vision is not None,
            "audio": llm.audio is not None,
            "speech_output": llm.speech_output is not None,
        },
    }
    if stats["engine_error"] is not None:
        body["reason"] = redact(f"engine failed: {stats['engine_error']}")
        body["error"] = engine_unavailable(body["reason"]).body()["error"]
    if ifb:
        a = admission.stats
        batch_full = stats["running"] >= launch.max_batch_size
        body["scheduling"] = {
            "submitted": stats["submitted"],
            "completed": stats["completed"],
            "cancelled": stats["cancelled"],
            "failed": stats["failed"],
            "joined_mid_flight": stats["joined_mid_flight"],
            "preemptions": stats["preemptions"],
            "refused": a.refused_queue_full + a.refused_queue_timeout,
            "wait_reasons": {
                "batch_full": stats["waiting"] if batch_full else 0,
                "kv_cache_full": 0 if batch_full else stats["waiting"],
            },
        }
    body["engine"] = {
        "running": stats["running"],
        "waiting": stats["waiting"],
        "kv_blocks_total": stats["kv_blocks_total"],
        "kv_blocks_free": stats["kv_blocks_free"],
        "kv_block_size": stats["kv_block_size"],
        "kv_cache_bytes": stats["kv_cache_bytes"],
        "steps": stats["steps"],
        "restarts": stats["restarts"],
    }
    if "ple_cache" in stats:  # Gemma 3n / Gemma 4: the per-layer embedding table's residency and pool
        body["engine"]["ple_cache"] = stats["ple_cache"]
    return body


async def read_body(request: Request, limit: int, timeout: float = BODY_TIMEOUT) -> bytes:
    """The request body, or 413 once it passes ``limit`` bytes, 408 if it takes over ``timeout`` s, 499
    if the client disconnects first."""
    too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
    except TimeoutError:
        raise APIError(
            408, f"the request body took over {timeout:g}s to arrive", code="request_timeout"
        ) from None
    except ClientDisconnect:  # nobody is left to answer: counted as 499 like a disconnect mid-stream
        raise APIError(499, "the client went away while sending the body", code="client_closed") from None
    return bytes(body)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Routing errors (unknown path 404, wrong method 405) in the same error shape as the rest."""
    if exc.status_code == 404:
        message = "no such endpoint (GET /openapi.json lists them)"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on this endpoint"
    else:
        message = exc.detail
    error = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    response = error.response()
    response.headers.update(exc.headers or {})
    return response


def _guard(handler, render=APIError.response):
    """APIError -> its response (OpenAI's shape unless ``render`` says otherwise); anything else -> 500
    without internals (logged here)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return render(e)
        except Exception:
            log.exception("internal error on %s %s", request.method, request.url.path)
            return render(internal_error())

    return endpoint


class _CountRequests:
    """Counts responses by endpoint and status code (unknown paths count as "other")."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = (
            path if path in ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        )

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
