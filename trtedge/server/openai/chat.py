"""POST /v1/chat/completions: an OpenAI chat request through the chat template and the shared pipeline,
answered as a chat.completion or its chunks."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trtedge.runtime.output import StreamDelta
from trtedge.server import sse
from trtedge.server.auth import cache_salt
from trtedge.server.chat_prompt import ChatPlan, call_id, prepare_chat
from trtedge.server.core import Output, ServingCore, stream_error
from trtedge.server.errors import bad_request
from trtedge.server.generation import Generation
from trtedge.server.openai.chat_audio import (
    AudioPlan,
    LiveAudio,
    audio_chunk,
    check_prompt,
    plan_audio,
    whole,
)
from trtedge.server.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from trtedge.server.openai.protocol import ChatCompletionRequest, _Sampling
from trtedge.server.parsers.output import merge


class ChatServing:
    def __init__(self, core: ServingCore):
        self.core = core

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        core = self.core
        core.refuse_unserved(req)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        refuse_streamed_prompt_logprobs(req)
        audio = plan_audio(core.llm, req)  # speech output: None for text only
        guide = await core.guide(req)
        plan = await prepare_chat(core, req, guide, salt=cache_salt(request, req.cache_salt))
        if audio is not None:
            check_prompt(plan)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        context = dict(req=req, plan=plan, rid=rid, created=created, audio=audio)
        events = functools.partial(self._chunks, **context) if req.stream else None
        answer = functools.partial(self._answer, **context)
        # with audio the seat stays taken until the Talker has spoken
        hold = audio is not None
        return await core.serve(
            req, plan.choices, rid, request, arrival, events=events, answer=answer, hold_seat=hold
        )

    async def _answer(
        self, outputs: list[Output], req, plan: ChatPlan, rid: str, created: int, audio: AudioPlan | None
    ) -> Response:
        token = self.core.token
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
                    "logprobs": {"content": chat_logprobs(token, o.logprobs)} if req.logprobs else None,
                    "finish_reason": reader.finish_reason(o.finish_reason),
                }
            )
            if req.prompt_logprobs is not None:
                prompt = plan.choices[0].prompt
                ids = list(getattr(prompt, "ids", prompt))
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(
                    token, ids, o.prompt_logprobs, req.prompt_logprobs
                )
            if audio is not None:  # OpenAI's shape: the text is the audio's transcript
                data = await whole(self.core.llm, audio, list(plan.choices[0].prompt), o.token_ids)
                message["audio"] = audio.audio_object(data, message["content"] or "")
                message["content"] = None
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.core.model_name,
            "choices": choices,
            "usage": usage(
                outputs[0].prompt_tokens, sum(o.completion_tokens for o in outputs), outputs[0].cached_tokens
            ),
        }
        return JSONResponse(body)

    async def _chunks(
        self, gen: Generation, req, plan, rid: str, created: int, audio: AudioPlan | None
    ) -> AsyncIterator[bytes]:
        core = self.core
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": core.model_name}
        if include_usage:
            head["usage"] = None

        def chunk(index: int, delta: dict, logprobs=None, finish=None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse.event({**head, "choices": [choice]})

        # with audio: the Talker speaks while the text streams; the finish is held for the end
        live = LiveAudio(core.llm, audio, list(plan.choices[0].prompt)) if audio is not None else None
        try:
            readers = [plan.reader() for _ in range(gen.num_choices)]
            ids: list[dict[int, str]] = [{} for _ in range(gen.num_choices)]
            for i in range(gen.num_choices):
                yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
            prompt_tokens, cached, completion = 0, 0, [0] * gen.num_choices
            held = None
            async for i, d in gen.deltas():
                if gen.cancelled:
                    return  # the client hung up
                deltas = [_chat_delta(e, ids[i]) for e in readers[i].feed(d)]
                infos = core.visible_logprobs(d) if req.logprobs else []
                finish = readers[i].finish_reason(d.finish_reason)
                if live is not None:
                    live.push(d.token_ids)
                    deltas = [_as_transcript(delta, audio.id) for delta in deltas]
                    held, finish = finish or held, None
                if not deltas and (finish or infos):
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    lp = (
                        {"content": chat_logprobs(core.token, infos if k == 0 else [])}
                        if req.logprobs
                        else None
                    )
                    yield chunk(i, delta, lp, finish if k == len(deltas) - 1 else None)
                prompt_tokens, completion[i] = d.prompt_tokens, d.completion_tokens
                if i == 0:
                    cached = d.cached_tokens
                for data in live.ready() if live is not None else ():
                    yield audio_chunk(head, audio.audio_object(data, None))
            if live is not None:
                async for data in live.rest():
                    if gen.cancelled:
                        return
                    yield audio_chunk(head, audio.audio_object(data, None))
                yield audio_chunk(head, audio.audio_object(None, None), held)
            if include_usage:
                yield sse.event(
                    {**head, "choices": [], "usage": usage(prompt_tokens, sum(completion), cached)}
                )
        except Exception as e:
            if gen.cancelled:
                return
            yield sse.event(stream_error(e), name="error")
        finally:
            if live is not None:
                live.close()
        yield sse.DONE


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


def refuse_streamed_prompt_logprobs(req: _Sampling) -> None:
    if req.stream and req.prompt_logprobs is not None:  # as vLLM: they come with the whole response
        raise bad_request("prompt_logprobs is not available when stream is true", param="prompt_logprobs")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens served by context reuse (a part of prompt_tokens)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
