"""POST /v1/messages and /v1/messages/count_tokens: Anthropic requests through the shared translation
core (one model, one admission controller, one path into the engine), answered in Anthropic's shapes."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trtedge.runtime.output import StreamDelta
from trtedge.runtime.sampling_params import GuidedDecodingParams
from trtedge.server import sse
from trtedge.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from trtedge.server.anthropic.translate import error_body, to_chat_request
from trtedge.server.auth import cache_salt
from trtedge.server.chat_prompt import ChatPlan, ChoiceReader, call_id, prepare_chat, prepare_prompt
from trtedge.server.core import Output, ServingCore
from trtedge.server.errors import APIError, internal_error
from trtedge.server.generation import Generation
from trtedge.server.openai.protocol import ChatCompletionRequest
from trtedge.server.parsers.output import merge

PING_SECONDS = 5.0


class AnthropicServing:
    def __init__(self, core: ServingCore, ping_seconds: float = PING_SECONDS):
        self.core = core
        self.ping_seconds = ping_seconds

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        self.core.check_model(req.model)
        prompt = await prepare_prompt(self.core, to_chat_request(req))
        return JSONResponse({"input_tokens": len(prompt.ids)})

    async def messages(self, req: MessagesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        core = self.core
        core.check_model(req.model)
        chat = to_chat_request(req)
        guide = await self._guide(req, chat)
        try:
            plan = await prepare_chat(core, chat, guide, salt=cache_salt(request, chat.cache_salt))
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            raise await self._too_long(chat, req.max_tokens, e) from None
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        stops = tuple(req.stop_sequences or ())
        events = functools.partial(self._events, plan=plan, rid=rid, stops=stops) if req.stream else None
        answer = functools.partial(self._answer, plan=plan, rid=rid, stops=stops)
        return await core.serve(chat, plan.choices, rid, request, arrival, events=events, answer=answer)

    def _answer(self, outputs: list[Output], plan: ChatPlan, rid: str, stops: tuple[str, ...]) -> Response:
        [out] = outputs
        reader = plan.reader()
        text = "".join(out.text)
        parsed = merge(reader.feed(StreamDelta(text, [], out.finish_reason)))
        content: list[dict] = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content and (parsed.content.strip() or not parsed.calls):
            content.append({"type": "text", "text": parsed.content})
        for call in parsed.calls:
            content.append(_tool_use(call_id("toolu_"), call.name, json.loads(call.arguments)))
        reason, stop = self._stop_reason(reader, out.finish_reason, out.token_ids, text, stops)
        return JSONResponse(
            {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": self.core.model_name,
                "content": content,
                "stop_reason": reason,
                "stop_sequence": stop,
                "stop_details": None,  # a refusal's details: this server never refuses on policy
                "usage": _usage(out.prompt_tokens, out.cached_tokens, out.completion_tokens),
            }
        )

    async def _too_long(self, chat, max_tokens: int, error: APIError) -> APIError:
        """``error`` (the prompt does not fit) in Anthropic's words, which clients parse: Claude Code
        retries with a smaller max_tokens on "input length and `max_tokens` exceed context limit:
        N + M > C" and compacts its conversation on "prompt is too long"."""
        config = self.core.llm.config
        try:
            num_prompt_tokens = len((await prepare_prompt(self.core, chat)).ids)
        except APIError:
            return error  # media past the limit: the prompt was never rendered
        if num_prompt_tokens > config.max_input_len:
            message = f"prompt is too long: {num_prompt_tokens} tokens > {config.max_input_len} maximum"
        elif 0 < num_prompt_tokens and num_prompt_tokens + max_tokens > config.max_kv_cache_capacity:
            message = (
                f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} + "
                f"{max_tokens} > {config.max_kv_cache_capacity}, decrease input length or `max_tokens` "
                "and try again"
            )
        else:
            return error
        return APIError(400, message, param=error.param, code=error.code)

    async def _guide(self, req: MessagesRequest, chat: ChatCompletionRequest) -> GuidedDecodingParams | None:
        """The guide of output_config.format (compiled now: a bad schema is a 400 naming that field)."""
        try:
            return await self.core.guide(chat)
        except APIError as e:
            if e.param != "response_format":
                raise
            e.param = "output_format" if req.output_format is not None else "output_config.format"
            raise

    def _stop_reason(
        self,
        reader: ChoiceReader,
        finish: str | None,
        token_ids: list[int],
        text: str,
        stops: tuple[str, ...],
    ) -> tuple[str, str | None]:
        if reader.finish_reason(finish) == "tool_calls":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if stops and token_ids and token_ids[-1] not in self.core.tokenizer_info.eos_token_ids:
            full = self.core.llm.detokenize(token_ids)
            found = [(full.find(s), s) for s in stops if s in full]
            if found:
                return "stop_sequence", min(found)[1]
        return "end_turn", None

    async def _events(
        self, gen: Generation, plan: ChatPlan, rid: str, stops: tuple[str, ...]
    ) -> AsyncIterator[bytes]:
        def event(name: str, data: dict) -> bytes:
            return sse.event({"type": name, **data}, name=name)

        prompt_tokens = plan.choices[0].num_prompt_tokens
        message = {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": self.core.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "stop_details": None,
            # context-reuse hits are known once the prompt is scheduled: message_delta has the final counts
            "usage": _usage(prompt_tokens, 0, 0),
        }
        yield event("message_start", {"message": message})
        yield event("ping", {})
        reader = plan.reader()
        blocks = _Blocks(event)
        text, token_ids, completion, cached, finish = [], [], 0, 0, None
        deltas = gen.deltas().__aiter__()
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(deltas.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=self.ping_seconds)
                if not done:
                    yield event("ping", {})
                    continue
                try:
                    _, d = pending.result()
                except StopAsyncIteration:
                    break
                pending = None
                if gen.cancelled:
                    return  # the client hung up
                text.append(d.text)
                token_ids += d.token_ids
                completion, cached, finish = d.completion_tokens, d.cached_tokens, d.finish_reason
                for e in reader.feed(d):
                    for chunk in blocks.add(e):
                        yield chunk
                if finish is not None:
                    break
            for chunk in blocks.close(final=True):
                yield chunk
            reason, stop = self._stop_reason(reader, finish, token_ids, "".join(text), stops)
            delta = {"stop_reason": reason, "stop_sequence": stop, "stop_details": None}
            usage = _usage(prompt_tokens, cached, completion)
            yield event("message_delta", {"delta": delta, "usage": usage})
            yield event("message_stop", {})
        except Exception as e:
            if gen.cancelled:
                return
            error = e if isinstance(e, APIError) else internal_error()
            yield sse.event(error_body(error)[1], name="error")
        finally:
            if pending is not None:
                pending.cancel()


class _Blocks:
    """Content blocks of a streamed message: one open at a time, each opened and closed once."""

    def __init__(self, event):
        self.event = event
        self.index = -1
        self.open: tuple | None = None  # ("text",) | ("thinking",) | ("tool_use", call index)

    def add(self, e: tuple) -> list[bytes]:
        kind = e[0]
        out: list[bytes] = []
        if kind in ("content", "reasoning"):
            block = "thinking" if kind == "reasoning" else "text"
            if self.open != (block,) and not e[1].strip():
                return out  # layout between blocks opens no block
            if self.open != (block,):
                out += self.close()
                empty = (
                    {"type": "thinking", "thinking": "", "signature": ""}
                    if block == "thinking"
                    else {"type": "text", "text": ""}
                )
                out += self._start((block,), empty)
            delta = (
                {"type": "thinking_delta", "thinking": e[1]}
                if block == "thinking"
                else {"type": "text_delta", "text": e[1]}
            )
            out.append(self.event("content_block_delta", {"index": self.index, "delta": delta}))
        elif kind == "call":
            out += self.close()
            out += self._start(("tool_use", e[1]), _tool_use(call_id("toolu_"), e[2], {}))
        elif self.open == ("tool_use", e[1]):
            delta = {"type": "input_json_delta", "partial_json": e[2]}
            out.append(self.event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def _start(self, key: tuple, block: dict) -> list[bytes]:
        self.index += 1
        self.open = key
        return [self.event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self, final: bool = False) -> list[bytes]:
        out: list[bytes] = []
        if final and self.index < 0:
            out += self._start(("text",), {"type": "text", "text": ""})
        if self.open is not None:
            out.append(self.event("content_block_stop", {"index": self.index}))
            self.open = None
        return out


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens counts the prompt tokens not read from the cache; context-reuse
    hits are cache reads; trtedge writes no cache entries of its own (cache_creation_input_tokens 0)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def _tool_use(block_id: str, name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": block_id, "name": name, "input": arguments}


def anthropic_error(error: APIError) -> JSONResponse:
    status, body = error_body(error)
    return JSONResponse(body, status_code=status, headers=error.headers)
