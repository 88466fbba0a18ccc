"""The request pipeline every API shares (/v1/chat/completions, /v1/completions, /v1/messages,
/v1/responses, /v1/audio/transcriptions).

``ServingCore`` is the one path into the engine: it checks the model and the request's guide, builds
``SamplingParams``, takes an admission seat, submits, and then either streams the API's events or
collects every choice's output (``serve``); a client that leaves while queued gets 499. The APIs only
translate their request into ``Choice``s (chat surfaces through ``chat_prompt.plan_chat``) and the
outputs into their wire format."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from trtedge.llm import LLM, EngineUnavailableError, GuidedUnavailableError, PromptTooLongError
from trtedge.runtime.output import StreamDelta, TokenLogprobs
from trtedge.runtime.sampling_params import GuidedDecodingParams, ParamError, SamplingParams
from trtedge.server import sse
from trtedge.server.admission import Admission
from trtedge.server.config import ServeConfig
from trtedge.server.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    internal_error,
    shutting_down,
)
from trtedge.server.generation import Choice, Generation
from trtedge.server.metrics import ServerMetrics
from trtedge.server.openai.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from trtedge.server.openai.structured import guide_from_request

log = logging.getLogger("trtedge.server")

_SAMPLING_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


@dataclass
class Output:
    """One choice's output, collected."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class ServingCore:
    """The model served, its admission queue and metrics, and the one request pipeline."""

    def __init__(self, llm: LLM, config: ServeConfig, admission: Admission, metrics: ServerMetrics):
        self.llm = llm
        self.config = config
        self.admission = admission
        self.metrics = metrics
        self.model_name = config.served_model_name or llm.model_name
        self.created = int(time.time())
        self.vocab_size = llm.vocab_size
        self.tokenizer_info = llm.tokenizer_info()
        self._live: weakref.WeakSet[Generation] = weakref.WeakSet()

    def abandon_all(self) -> None:
        """End every request in flight or queued with 503 ``shutting_down`` (a second Ctrl-C)."""
        self.admission.refuse_waiting(shutting_down())
        for gen in list(self._live):
            gen.abandon(shutting_down())

    # ---- the model -----------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "trtedge",
            "root": self.model_name,  # never a server path
            "max_model_len": self.llm.config.max_kv_cache_capacity,
        }

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def refuse_unserved(self, req: _Sampling) -> None:
        """A request for another model, or below the server's --min-request-priority."""
        self.check_model(req.model)
        minimum = self.llm.config.min_request_priority
        if minimum is not None and req.priority < minimum:
            raise bad_request(
                f"priority {req.priority} is below the server's --min-request-priority {minimum}",
                param="priority",
            )

    def empty_prompt(self) -> list[int]:
        """What an empty prompt is served as: the start of a document (OpenAI's default prompt is its
        end-of-text token), i.e. the model's BOS token, else its first end-of-text token (else none)."""
        info = self.tokenizer_info
        if info.bos_token_id is not None:
            return [info.bos_token_id]
        return sorted(info.eos_token_ids)[:1]

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one serving object per server)
    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text (a part of a character shown as U+FFFD) and its bytes, for logprobs."""
        raw = self.llm.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def visible_logprobs(self, d: StreamDelta) -> list[TokenLogprobs]:
        """Logprobs of the tokens that made text: an EOS that ended the answer is not reported."""
        infos = list(d.logprobs or [])
        if infos and d.finish_reason == "stop" and not d.text:
            if infos[-1].token_id in self.tokenizer_info.eos_token_ids:
                infos.pop()
        return infos

    # ---- the request ---------------------------------------------------------------------------
    async def guide(self, req: _Sampling) -> GuidedDecodingParams | None:
        """The request's structured-output guide, compiled now (off the event loop, cached by the engine) so
        that a bad one is a 400 naming the field before the request takes a seat."""
        guide, field = guide_from_request(req)
        await self.compile(guide, field)
        return guide

    async def compile(self, guide: GuidedDecodingParams | None, field: str | None) -> None:
        if guide is None:
            return
        try:
            await asyncio.to_thread(self.llm.compile_guide, guide)
        except GuidedUnavailableError as e:
            raise APIError(501, str(e), param=field, code="structured_output_unavailable") from None
        except ValueError as e:
            raise bad_request(str(e), param=field, code="invalid_guide") from None

    def params(
        self,
        req: _Sampling,
        num_prompt_tokens: int,
        max_tokens: int | None,
        logprobs: int | None,
        param: str,
        guide: GuidedDecodingParams | None = None,
        salt: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's ``SamplingParams``: its fields over --override-generation-config's defaults;
        ``max_tokens`` None: what is left of the context. ``param``: the field that holds the prompt."""
        capacity = self.llm.config.max_kv_cache_capacity
        defaults = self.config.generation_defaults  # --override-generation-config
        if prompt_logprobs is None:
            prompt_logprobs = req.prompt_logprobs
        explicit = max_tokens is not None
        if not explicit:
            max_tokens = max(capacity - num_prompt_tokens, 1)  # what is left of the context, like vLLM
            max_tokens = min(max_tokens, defaults.get("max_new_tokens", max_tokens))
        if num_prompt_tokens == 0:
            raise bad_request("the prompt is empty", param=param, code="invalid_value")
        try:
            self.llm.check_lengths(num_prompt_tokens, max_tokens)
        except PromptTooLongError as e:
            too_long = num_prompt_tokens > self.llm.config.max_input_len or not explicit
            raise bad_request(
                str(e), param=param if too_long else "max_tokens", code="context_length_exceeded"
            ) from None
        options = {name: getattr(req, name) for name in _SAMPLING_OPTIONS if getattr(req, name) is not None}
        options = {k: v for k, v in defaults.items() if k != "max_new_tokens"} | options
        if options.get("top_k") == 0:
            options["top_k"] = -1  # 0 is "off" too, as in vLLM (the document allows it)
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        stop = [s for s in stop if s]  # an empty stop string matches nothing: served as none
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                n=req.n,  # the engine forks the choices from one prefill; choice i > 0 derives its seed
                stop=tuple(stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                seed=req.seed,
                logit_bias=req.logit_bias,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                reuse_context=req.reuse_context,
                cache_generated_tokens=req.cache_generated_tokens,
                skip_special_tokens=req.skip_special_tokens,
                disable_spec_decode=req.disable_spec_decode,
                guided_decoding=guide,
                cache_salt=salt,
                **options,
            )
        except ValueError as e:
            raise value_error(e, param) from None

    async def serve(
        self,
        req: _Sampling,
        choices: list[Choice],
        rid: str,
        request: Request,
        arrival: float,
        *,
        events: Callable[[Generation], AsyncIterator[bytes]] | None,
        answer: Callable[[list[Output]], Response | Awaitable[Response]],
        with_eos: bool = False,
        hold_seat: bool = False,
    ) -> Response:
        """The pipeline: take a seat (maybe waiting in the queue), submit ``choices``, then stream
        ``events(generation)`` as server-sent events, or, with ``events`` None, answer ``answer(outputs)``
        once every choice has finished (``with_eos``: see ``collect``; ``hold_seat``: the seat stays
        taken while ``answer`` runs, as speech output needs). 499 when the client left while queued."""
        started = await self.start(req, choices, rid, request, arrival)
        if started is None:
            return Response(status_code=499)
        gen, watcher = started
        if events is not None:
            return sse.SSEResponse(events(gen), on_close=closer(gen, watcher), ready=gen.has_pending)
        outputs = await self.collect(gen, watcher, with_eos=with_eos, keep_open=hold_seat)
        try:
            response = answer(outputs)
            return await response if inspect.isawaitable(response) else response
        finally:
            gen.close()

    async def start(
        self, req: _Sampling, choices: list[Choice], rid: str, request: Request, arrival: float
    ) -> tuple[Generation, sse.DisconnectWatcher] | None:
        """Take a seat (maybe waiting in the queue), then submit. None when the client left while
        queued; the caller closes the generation and stops the watcher (``closer``)."""
        for choice in choices:  # a guide compiles off the event loop, before the request takes a seat
            await self.compile(choice.params.guided_decoding, "tools")
        watcher = sse.DisconnectWatcher(request.receive)
        try:
            seat = await self.admission.acquire(req.priority, abort=watcher.gone)
        except asyncio.CancelledError:
            watcher.stop()
            if watcher.gone.is_set():
                return None
            raise
        except BaseException:
            watcher.stop()
            raise
        self.metrics.queue_time.observe(time.monotonic() - arrival)
        try:
            gen = Generation(
                self.llm,
                choices,
                seat=seat,
                metrics=self.metrics,
                request_id=rid,
                priority=req.priority,
                arrival=arrival,
            )
        except ValueError as e:
            watcher.stop()
            raise value_error(e, "messages" if isinstance(req, ChatCompletionRequest) else "prompt") from None
        except EngineUnavailableError as e:
            watcher.stop()
            raise engine_unavailable(str(e)) from None
        except BaseException:
            watcher.stop()
            seat.release()
            raise
        watcher.on_disconnect(gen.cancel)
        self._live.add(gen)
        return gen, watcher

    async def collect(
        self, gen: Generation, watcher: sse.DisconnectWatcher, with_eos: bool = False, keep_open: bool = False
    ) -> list[Output]:
        """Every choice's output; ``with_eos`` keeps the logprob of an EOS that ended a choice (completions
        report it, as vLLM does: one entry per completion token); ``keep_open``: the caller closes ``gen``
        (its seat stays taken meanwhile)."""
        outputs = [Output() for _ in range(gen.num_choices)]
        done = False
        try:
            async for i, d in gen.deltas():
                o = outputs[i]
                o.text.append(d.text)
                o.token_ids.extend(d.token_ids)
                o.logprobs.extend((d.logprobs or []) if with_eos else self.visible_logprobs(d))
                o.finish_reason = d.finish_reason
                o.prompt_tokens, o.completion_tokens = d.prompt_tokens, d.completion_tokens
                o.cached_tokens = d.cached_tokens
                if d.prompt_logprobs is not None:
                    o.prompt_logprobs = d.prompt_logprobs
            done = True
        except APIError:
            raise
        except Exception:
            log.exception("generation failed")
            raise internal_error() from None
        finally:
            watcher.stop()
            if not (keep_open and done):  # a failed one is closed here all the same
                gen.close()
        return outputs


def closer(gen: Generation, watcher: sse.DisconnectWatcher) -> Callable[[], None]:
    def close() -> None:
        watcher.stop()
        gen.close()

    return close


def stream_error(error: Exception) -> dict:
    """The body of a stream's error event (an unexpected error is logged and shown as a 500)."""
    if isinstance(error, APIError):
        return error.body()
    log.exception("generation failed mid-stream", exc_info=error)
    return internal_error().body()


def value_error(error: ValueError, default_param: str) -> APIError:
    """A runtime ValueError as a 400 naming the request field it is about (a ``ParamError``'s, when the
    request has that field; else ``default_param``)."""
    param = error.param if isinstance(error, ParamError) else None
    known = param in ChatCompletionRequest.model_fields or param in CompletionRequest.model_fields
    return bad_request(str(error), param=param if known else default_param)
