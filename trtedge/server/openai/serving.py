"""Translate OpenAI requests into ``LLM`` calls and engine deltas into OpenAI responses and chunks."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trtedge.llm import LLM, GuidedUnavailableError, PromptTooLongError
from trtedge.runtime.output import StreamDelta, TokenLogprobs
from trtedge.runtime.sampling_params import GuidedDecodingParams, SamplingParams
from trtedge.server import sse
from trtedge.server.admission import Admission
from trtedge.server.auth import cache_salt
from trtedge.server.config import ServeConfig
from trtedge.server.core import call_id, prepare_chat
from trtedge.server.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    internal_error,
    not_supported,
    shutting_down,
)
from trtedge.server.generation import Choice, Generation
from trtedge.server.metrics import ServerMetrics
from trtedge.server.openai.chat_audio import audio_chunk, check_prompt, plan_audio, speak, whole
from trtedge.server.openai.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from trtedge.server.openai.structured import guide_from_request
from trtedge.server.parsers.output import merge

log = logging.getLogger("trtedge.server")


@dataclass
class _Output:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class _CompletionView:
    """How a completion request's choices are reported: the echoed prompt text and ids per choice,
    whether the echo carries the prompt's logprobs, and whether generation is left out (max_tokens 0)."""

    echoes: list[str]
    prompt_ids: list[list[int]]
    echo_logprobs: bool
    score_only: bool


class OpenAIServing:
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

    # ---- models --------------------------------------------------------------------------------
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

    # ---- chat ----------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._refuse_unserved(req)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        _refuse_streamed_prompt_logprobs(req)
        audio = plan_audio(self.llm, req)  # speech output: None for text only
        guide = await self._guide(req)
        plan = await prepare_chat(self, req, guide, salt=cache_salt(request, req.cache_salt))
        if audio is not None:
            check_prompt(plan)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen, watcher = await self._start(req, plan.choices, rid, request, arrival)
        if gen is None:
            return Response(status_code=499)
        created = int(time.time())
        if req.stream:
            return sse.SSEResponse(
                self._chat_chunks(gen, req, plan, rid, created, audio), on_close=_closer(gen, watcher)
            )
        # with audio the seat stays taken until the Talker has spoken
        outputs = await self._collect(gen, watcher, keep_open=audio is not None)
        try:
            body = await self._chat_body(req, plan, outputs, rid, created, audio)
        finally:
            gen.close()
        return JSONResponse(body)

    async def _chat_body(self, req, plan, outputs, rid: str, created: int, audio) -> dict:
        choices = []
        for i, o in enumerate(outputs):
            reader = plan.reader()
            parsed = merge(reader.feed(StreamDelta("".join(o.text), [], o.finish_reason)))
            message: dict = {"role": "assistant", "content": parsed.content, "refusal": None}
            if plan.reasoning is not None:
                message["reasoning_content"] = parsed.reasoning or None
            if parsed.calls:
                message["content"] = parsed.content if parsed.content.strip() else None
                message["tool_calls"] = [
                    {
                        "id": call_id(),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in parsed.calls
                ]
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": {"content": self._chat_logprobs(o.logprobs)} if req.logprobs else None,
                    "finish_reason": reader.finish_reason(o.finish_reason),
                }
            )
            if req.prompt_logprobs is not None:
                prompt = plan.choices[0].prompt
                ids = list(getattr(prompt, "ids", prompt))
                choices[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(
                    ids, o.prompt_logprobs, req.prompt_logprobs
                )
            if audio is not None:  # OpenAI's shape: the text is the audio's transcript
                data = await whole(self.llm, audio, list(plan.choices[0].prompt), o.token_ids)
                message["audio"] = audio.audio_object(data, message["content"] or "")
                message["content"] = None
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(
                outputs[0].prompt_tokens, sum(o.completion_tokens for o in outputs), outputs[0].cached_tokens
            ),
        }

    async def _chat_chunks(
        self, gen: Generation, req, plan, rid: str, created: int, audio=None
    ) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        if include_usage:
            head["usage"] = None

        def chunk(index: int, delta: dict, logprobs=None, finish=None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse.event({**head, "choices": [choice]})

        try:
            readers = [plan.reader() for _ in range(gen.num_choices)]
            ids: list[dict[int, str]] = [{} for _ in range(gen.num_choices)]
            for i in range(gen.num_choices):
                yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
            prompt_tokens, cached, completion = 0, 0, [0] * gen.num_choices
            spoken: list[int] = []  # with audio: the answer's ids, and its finish held for the end
            held = None
            async for i, d in gen.deltas():
                if gen.cancelled:
                    return  # the client hung up
                deltas = [_chat_delta(e, ids[i]) for e in readers[i].feed(d)]
                infos = self._visible_logprobs(d) if req.logprobs else []
                finish = readers[i].finish_reason(d.finish_reason)
                if audio is not None:
                    spoken.extend(d.token_ids)
                    deltas = [_as_transcript(delta, audio.id) for delta in deltas]
                    held, finish = finish or held, None
                if not deltas and (finish or infos):
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    lp = {"content": self._chat_logprobs(infos if k == 0 else [])} if req.logprobs else None
                    yield chunk(i, delta, lp, finish if k == len(deltas) - 1 else None)
                prompt_tokens, completion[i] = d.prompt_tokens, d.completion_tokens
                if i == 0:
                    cached = d.cached_tokens
            if audio is not None:
                async for data in speak(self.llm, audio, list(plan.choices[0].prompt), spoken):
                    if gen.cancelled:
                        return
                    yield audio_chunk(head, audio.audio_object(data, None))
                yield audio_chunk(head, audio.audio_object(None, None), held)
            if include_usage:
                usage = _usage(prompt_tokens, sum(completion), cached)
                yield sse.event({**head, "choices": [], "usage": usage})
        except Exception as e:
            if gen.cancelled:
                return
            yield sse.event(_stream_error(e), name="error")
        yield sse.DONE

    def _chat_logprobs(self, infos: list[TokenLogprobs]) -> list[dict]:
        return [
            {
                **self._token_entry(info.token_id, info.logprob),
                "top_logprobs": [self._token_entry(t, lp) for t, lp in info.top],
            }
            for info in infos
        ]

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self._token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    # ---- completions ---------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._refuse_unserved(req)
        if req.suffix is not None:
            raise not_supported("suffix (fill-in-the-middle)", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise not_supported("best_of other than n", "best_of")
        _refuse_streamed_prompt_logprobs(req)
        # echo + logprobs: the prompt's own token logprobs lead the logprobs (lm-eval's loglikelihood)
        echo_logprobs = req.echo and req.logprobs is not None
        scored = [k for k in (req.logprobs if echo_logprobs else None, req.prompt_logprobs) if k is not None]
        score_only = req.max_tokens == 0  # the prefill samples one token anyway; it is not reported
        prompts = req.prompt if isinstance(req.prompt, list) and req.prompt else [req.prompt]
        if isinstance(prompts[0], int):
            prompts = [req.prompt]
        guide = await self._guide(req)
        choices, echoes, prompt_ids = [], [], []
        salt = cache_salt(request, req.cache_salt)
        for p, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{p}"
            if isinstance(prompt, str):
                ids = self.llm.encode_prompt(prompt, apply_chat_template=False) or self.empty_prompt()
            else:
                ids = list(prompt) or self.empty_prompt()
                if any(t >= self.vocab_size for t in ids):
                    raise bad_request(
                        f"token ids must be < the vocabulary size {self.vocab_size}", param=param
                    )
            echo = ""
            if req.echo:
                echo = (
                    prompt if isinstance(prompt, str) else self.llm.detokenize(ids, skip_special_tokens=False)
                )
            max_tokens = 1 if score_only else req.max_tokens
            params = self._params(
                req,
                len(ids),
                max_tokens,
                req.logprobs,
                param,
                guide=guide,
                salt=salt,
                prompt_logprobs=max(scored) if scored else None,
            )
            choices.append(Choice(ids, params))
            echoes += [echo] * req.n
            prompt_ids += [ids] * req.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen, watcher = await self._start(req, choices, rid, request, arrival)
        if gen is None:
            return Response(status_code=499)
        created = int(time.time())
        view = _CompletionView(echoes, prompt_ids, echo_logprobs, score_only)
        if req.stream:
            return sse.SSEResponse(
                self._completion_chunks(gen, req, rid, created, view), on_close=_closer(gen, watcher)
            )
        outputs = await self._collect(gen, watcher, with_eos=True)
        choices_out = []
        for i, o in enumerate(outputs):
            if score_only:
                o.text, o.logprobs, o.finish_reason, o.completion_tokens = [], [], "length", 0
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(o.logprobs, len(echoes[i]))
                if echo_logprobs:
                    logprobs = _joined(
                        self._echo_logprobs(prompt_ids[i], o.prompt_logprobs, req.logprobs), logprobs
                    )
            choice = {
                "index": i,
                "text": echoes[i] + "".join(o.text),
                "logprobs": logprobs,
                "finish_reason": o.finish_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(
                    prompt_ids[i], o.prompt_logprobs, req.prompt_logprobs
                )
            choices_out.append(choice)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices_out,
            "usage": _usage(
                sum(o.prompt_tokens for o in outputs[:: req.n]),
                sum(o.completion_tokens for o in outputs),
                sum(o.cached_tokens for o in outputs[:: req.n]),
            ),
        }
        return JSONResponse(body)

    async def _completion_chunks(self, gen, req, rid, created, view: _CompletionView) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if include_usage:
            head["usage"] = None
        echoes = view.echoes
        offsets = [len(e) for e in echoes]
        started = [False] * len(echoes)

        def chunk(index: int, text: str, logprobs=None, finish=None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse.event({**head, "choices": [choice]})

        try:
            if not view.echo_logprobs:  # the echo goes first; with its logprobs, once the prefill gave them
                for i, echo in enumerate(echoes):
                    if echo:
                        yield chunk(i, echo)
            prompt_tokens, completion, cached = [0] * len(echoes), [0] * len(echoes), [0] * len(echoes)
            async for i, d in gen.deltas():
                if gen.cancelled:
                    return  # the client hung up
                if view.echo_logprobs and not started[i]:
                    started[i] = True
                    k = req.logprobs
                    yield chunk(i, echoes[i], self._echo_logprobs(view.prompt_ids[i], d.prompt_logprobs, k))
                if view.score_only:
                    if d.finish_reason is not None:
                        empty = (
                            self._completion_logprobs([], offsets[i]) if req.logprobs is not None else None
                        )
                        yield chunk(i, "", empty, "length")
                        prompt_tokens[i] = d.prompt_tokens
                    continue
                infos = list(d.logprobs or []) if req.logprobs is not None else []
                if not d.text and not d.finish_reason and not infos:
                    continue
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(infos, offsets[i])
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                yield chunk(i, d.text, lp, d.finish_reason)
                prompt_tokens[i], completion[i] = d.prompt_tokens, d.completion_tokens
                cached[i] = d.cached_tokens
            if include_usage:
                usage = _usage(sum(prompt_tokens[:: req.n]), sum(completion), sum(cached[:: req.n]))
                yield sse.event({**head, "choices": [], "usage": usage})
        except Exception as e:
            if gen.cancelled:
                return
            yield sse.event(_stream_error(e), name="error")
        yield sse.DONE

    def _completion_logprobs(self, infos: list[TokenLogprobs], offset: int) -> dict:
        tokens, offsets = [], []
        for info in infos:
            text = self._token(info.token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [info.logprob for info in infos],
            "top_logprobs": [{self._token(t)[0]: lp for t, lp in info.top} for info in infos],
            "text_offset": offsets,
        }

    def _echo_logprobs(self, ids: list[int], infos: list[TokenLogprobs | None] | None, k: int) -> dict:
        """The prompt's part of an echo's logprobs, in OpenAI's shape: the first token has none."""
        infos = infos or [None] * len(ids)
        tokens, offsets, offset = [], [], 0
        for t in ids:
            text = self._token(t)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [info.logprob if info is not None else None for info in infos],
            "top_logprobs": [
                {self._token(t)[0]: lp for t, lp in info.top[:k]} if info is not None else None
                for info in infos
            ],
            "text_offset": offsets,
        }

    def _vllm_prompt_logprobs(self, ids: list[int], infos: list[TokenLogprobs | None] | None, k: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token (the first: null) its own entry and the top ``k``, each
        ``{token id: {logprob, rank, decoded_token}}``."""
        out: list = []
        for info in infos or [None] * len(ids):
            if info is None:
                out.append(None)
                continue
            entry = {str(info.token_id): self._vllm_entry(info.token_id, info.logprob, info.rank)}
            for rank, (t, lp) in enumerate(info.top[:k], start=1):
                entry.setdefault(str(t), self._vllm_entry(t, lp, rank))
            out.append(entry)
        return out

    def _vllm_entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token(token_id)[0]}

    # ---- shared --------------------------------------------------------------------------------
    def empty_prompt(self) -> list[int]:
        """What an empty prompt is served as: the start of a document (OpenAI's default prompt is its
        end-of-text token), i.e. the model's BOS token, else its first end-of-text token (else none)."""
        info = self.tokenizer_info
        if info.bos_token_id is not None:
            return [info.bos_token_id]
        return sorted(info.eos_token_ids)[:1]

    def _refuse_unserved(self, req: _Sampling) -> None:
        self.check_model(req.model)
        minimum = self.llm.config.min_request_priority
        if minimum is not None and req.priority < minimum:
            raise bad_request(
                f"priority {req.priority} is below the server's --min-request-priority {minimum}",
                param="priority",
            )

    async def _guide(self, req: _Sampling) -> GuidedDecodingParams | None:
        """The request's structured-output guide, compiled now (off the event loop, cached by the engine) so
        that a bad one is a 400 naming the field before the request takes a seat."""
        guide, field = guide_from_request(req)
        await self._compile(guide, field)
        return guide

    async def _compile(self, guide: GuidedDecodingParams | None, field: str | None) -> None:
        if guide is None:
            return
        try:
            await asyncio.to_thread(self.llm.compile_guide, guide)
        except GuidedUnavailableError as e:
            raise APIError(501, str(e), param=field, code="structured_output_unavailable") from None
        except ValueError as e:
            raise bad_request(str(e), param=field, code="invalid_guide") from None

    def _params(
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
        options = {
            name: getattr(req, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "frequency_penalty",
                "presence_penalty",
                "repetition_penalty",
            )
            if getattr(req, name) is not None
        }
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
            raise _value_error(e, param) from None

    async def _start(self, req: _Sampling, choices, rid: str, request: Request, arrival: float):
        """Take a seat (maybe waiting in the queue), then submit. Returns (None, None) when the client
        left while queued."""
        for choice in choices:  # a guide compiles off the event loop, before the request takes a seat
            await self._compile(choice.params.guided_decoding, "tools")
        watcher = sse.DisconnectWatcher(request.receive)
        try:
            seat = await self.admission.acquire(req.priority, abort=watcher.gone)
        except asyncio.CancelledError:
            watcher.stop()
            if watcher.gone.is_set():
                return None, None
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
            raise _value_error(
                e, "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            ) from None
        except RuntimeError as e:
            watcher.stop()
            raise engine_unavailable(str(e)) from None
        except BaseException:
            watcher.stop()
            seat.release()
            raise
        watcher.on_disconnect(gen.cancel)
        self._live.add(gen)
        return gen, watcher

    async def _collect(
        self, gen: Generation, watcher: sse.DisconnectWatcher, with_eos: bool = False, keep_open: bool = False
    ) -> list[_Output]:
        """Every choice's output; ``with_eos`` keeps the logprob of an EOS that ended a choice (completions
        report it, as vLLM does: one entry per completion token); ``keep_open``: the caller closes ``gen``
        (its seat stays taken meanwhile)."""
        outputs = [_Output() for _ in range(gen.num_choices)]
        done = False
        try:
            async for i, d in gen.deltas():
                o = outputs[i]
                o.text.append(d.text)
                o.token_ids.extend(d.token_ids)
                o.logprobs.extend((d.logprobs or []) if with_eos else self._visible_logprobs(d))
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

    def _visible_logprobs(self, d) -> list[TokenLogprobs]:
        """Logprobs of the tokens that made text: an EOS that ended the answer is not reported."""
        infos = list(d.logprobs or [])
        if infos and d.finish_reason == "stop" and not d.text:
            if infos[-1].token_id in self.tokenizer_info.eos_token_ids:
                infos.pop()
        return infos

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one serving object per server)
    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = self.llm.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw


def _chat_delta(event: tuple, ids: dict[int, str]) -> dict:
    kind = event[0]
    if kind == "reasoning":
        return {"reasoning_content": event[1]}
    if kind == "content":
        return {"content": event[1]}
    if kind == "call":
        ids[event[1]] = call_id()
        function = {"name": event[2], "arguments": ""}
        return {
            "tool_calls": [{"index": event[1], "id": ids[event[1]], "type": "function", "function": function}]
        }
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


def _as_transcript(delta: dict, audio_id: str) -> dict:
    """A content delta as OpenAI streams the text of an audio answer."""
    if "content" not in delta:
        return delta
    rest = {k: v for k, v in delta.items() if k != "content"}
    return {**rest, "audio": {"id": audio_id, "transcript": delta["content"]}}


def _refuse_streamed_prompt_logprobs(req: _Sampling) -> None:
    if req.stream and req.prompt_logprobs is not None:  # as vLLM: they come with the whole response
        raise bad_request("prompt_logprobs is not available when stream is true", param="prompt_logprobs")


def _joined(first: dict, second: dict) -> dict:
    """Two completion logprobs objects as one (the echoed prompt's, then the generated tokens')."""
    return {key: first[key] + second[key] for key in first}


def _closer(gen: Generation, watcher: sse.DisconnectWatcher):
    def close() -> None:
        watcher.stop()
        gen.close()

    return close


def _value_error(error: ValueError, default_param: str) -> APIError:
    """A runtime ValueError as a 400 naming the field its message starts with (else ``default_param``)."""
    name = str(error).split(" ", 1)[0]
    known = name in ChatCompletionRequest.model_fields or name in CompletionRequest.model_fields
    return bad_request(str(error), param=name if known else default_param)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens served by context reuse (a part of prompt_tokens)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _stream_error(error: Exception) -> dict:
    if isinstance(error, APIError):
        return error.body()
    log.exception("generation failed mid-stream", exc_info=error)
    return internal_error().body()
