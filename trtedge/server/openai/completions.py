"""POST /v1/completions: text (or token id) prompts through the shared pipeline, answered as a
text_completion or its chunks; echo and logprobs as OpenAI reports them, prompt_logprobs as vLLM does."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trtedge.server import sse
from trtedge.server.auth import cache_salt
from trtedge.server.core import Output, ServingCore, stream_error
from trtedge.server.errors import bad_request, not_supported
from trtedge.server.generation import Choice
from trtedge.server.openai.chat import refuse_streamed_prompt_logprobs, usage
from trtedge.server.openai.logprobs import completion_logprobs, echo_logprobs, joined, vllm_prompt_logprobs
from trtedge.server.openai.protocol import CompletionRequest


@dataclass(frozen=True)
class _CompletionView:
    """How a completion request's choices are reported: the echoed prompt text and ids per choice,
    whether the echo carries the prompt's logprobs, and whether generation is left out (max_tokens 0)."""

    echoes: list[str]
    prompt_ids: list[list[int]]
    echo_logprobs: bool
    score_only: bool


class CompletionServing:
    def __init__(self, core: ServingCore):
        self.core = core

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        core = self.core
        core.refuse_unserved(req)
        if req.suffix is not None:
            raise not_supported("suffix (fill-in-the-middle)", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise not_supported("best_of other than n", "best_of")
        refuse_streamed_prompt_logprobs(req)
        # echo + logprobs: the prompt's own token logprobs lead the logprobs (lm-eval's loglikelihood)
        with_echo_logprobs = req.echo and req.logprobs is not None
        scored = [
            k for k in (req.logprobs if with_echo_logprobs else None, req.prompt_logprobs) if k is not None
        ]
        score_only = req.max_tokens == 0  # the prefill samples one token anyway; it is not reported
        prompts = req.prompt if isinstance(req.prompt, list) and req.prompt else [req.prompt]
        if isinstance(prompts[0], int):
            prompts = [req.prompt]
        guide = await core.guide(req)
        choices, echoes, prompt_ids = [], [], []
        salt = cache_salt(request, req.cache_salt)
        for p, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{p}"
            if isinstance(prompt, str):
                ids = core.llm.tokenize(prompt) or core.empty_prompt()
            else:
                ids = list(prompt) or core.empty_prompt()
                if any(t >= core.vocab_size for t in ids):
                    raise bad_request(
                        f"token ids must be < the vocabulary size {core.vocab_size}", param=param
                    )
            echo = ""
            if req.echo:
                echo = (
                    prompt if isinstance(prompt, str) else core.llm.detokenize(ids, skip_special_tokens=False)
                )
            max_tokens = 1 if score_only else req.max_tokens
            params = core.params(
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
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        view = _CompletionView(echoes, prompt_ids, with_echo_logprobs, score_only)
        context = dict(req=req, rid=rid, created=created, view=view)
        events = functools.partial(self._chunks, **context) if req.stream else None
        answer = functools.partial(self._answer, **context)
        return await core.serve(
            req, choices, rid, request, arrival, events=events, answer=answer, with_eos=True
        )

    def _answer(self, outputs: list[Output], req, rid: str, created: int, view: _CompletionView) -> Response:
        token = self.core.token
        echoes, prompt_ids = view.echoes, view.prompt_ids
        choices = []
        for i, o in enumerate(outputs):
            if view.score_only:
                o.text, o.logprobs, o.finish_reason, o.completion_tokens = [], [], "length", 0
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(token, o.logprobs, len(echoes[i]))
                if view.echo_logprobs:
                    echoed = echo_logprobs(token, prompt_ids[i], o.prompt_logprobs, req.logprobs)
                    logprobs = joined(echoed, logprobs)
            choice = {
                "index": i,
                "text": echoes[i] + "".join(o.text),
                "logprobs": logprobs,
                "finish_reason": o.finish_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    token, prompt_ids[i], o.prompt_logprobs, req.prompt_logprobs
                )
            choices.append(choice)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.core.model_name,
            "choices": choices,
            "usage": usage(
                sum(o.prompt_tokens for o in outputs[:: req.n]),
                sum(o.completion_tokens for o in outputs),
                sum(o.cached_tokens for o in outputs[:: req.n]),
            ),
        }
        return JSONResponse(body)

    async def _chunks(self, gen, req, rid, created, view: _CompletionView) -> AsyncIterator[bytes]:
        token = self.core.token
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.core.model_name}
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
                    echoed = echo_logprobs(token, view.prompt_ids[i], d.prompt_logprobs, req.logprobs)
                    yield chunk(i, echoes[i], echoed)
                if view.score_only:
                    if d.finish_reason is not None:
                        empty = (
                            completion_logprobs(token, [], offsets[i]) if req.logprobs is not None else None
                        )
                        yield chunk(i, "", empty, "length")
                        prompt_tokens[i] = d.prompt_tokens
                    continue
                infos = list(d.logprobs or []) if req.logprobs is not None else []
                if not d.text and not d.finish_reason and not infos:
                    continue
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(token, infos, offsets[i])
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                yield chunk(i, d.text, lp, d.finish_reason)
                prompt_tokens[i], completion[i] = d.prompt_tokens, d.completion_tokens
                cached[i] = d.cached_tokens
            if include_usage:
                totals = usage(sum(prompt_tokens[:: req.n]), sum(completion), sum(cached[:: req.n]))
                yield sse.event({**head, "choices": [], "usage": totals})
        except Exception as e:
            if gen.cancelled:
                return
            yield sse.event(stream_error(e), name="error")
        yield sse.DONE
