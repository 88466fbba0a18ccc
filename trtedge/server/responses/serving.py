"""POST /v1/responses: OpenAI Responses requests through the shared translation core, answered as a
Response object or its event stream. Responses are not stored (previous_response_id is refused)."""

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
from trtedge.server.core import Output, ServingCore
from trtedge.server.errors import APIError, internal_error
from trtedge.server.generation import Generation
from trtedge.server.responses.protocol import ResponsesRequest
from trtedge.server.responses.translate import namespaces, to_chat_request


class ResponsesServing:
    def __init__(self, core: ServingCore):
        self.core = core

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        core = self.core
        core.check_model(req.model)
        chat = to_chat_request(req)
        guide = await core.guide(chat)
        plan = await prepare_chat(core, chat, guide, salt=cache_salt(request, chat.cache_salt))
        rid = f"resp_{uuid.uuid4().hex}"
        head = _Head(rid, int(time.time()), core.model_name, req, chat)
        events = functools.partial(self._events, plan=plan, head=head) if req.stream else None
        answer = functools.partial(self._answer, plan=plan, head=head)
        return await core.serve(chat, plan.choices, rid, request, arrival, events=events, answer=answer)

    def _answer(self, outputs: list[Output], plan: ChatPlan, head: _Head) -> Response:
        [out] = outputs
        req = head.req
        items = _Items(namespaces(req.tools))
        reader = plan.reader()
        for event in reader.feed(StreamDelta("".join(out.text), [], out.finish_reason)):
            items.add(event)
        items.close()
        return JSONResponse(
            head.response(
                items.done, out.finish_reason, out.prompt_tokens, out.completion_tokens, out.cached_tokens
            )
        )

    async def _events(self, gen: Generation, plan: ChatPlan, head: _Head) -> AsyncIterator[bytes]:
        seq = 0

        def event(data: dict) -> bytes:
            nonlocal seq
            seq += 1
            return sse.event({**data, "sequence_number": seq - 1}, name=data["type"])

        yield event({"type": "response.created", "response": head.response([], None, 0, 0)})
        yield event({"type": "response.in_progress", "response": head.response([], None, 0, 0)})
        reader = plan.reader()
        items = _Items(namespaces(head.req.tools))
        prompt, completion, cached, finish = plan.choices[0].num_prompt_tokens, 0, 0, None
        try:
            async for _, d in gen.deltas():
                if gen.cancelled:
                    return  # the client hung up
                completion, cached, finish = d.completion_tokens, d.cached_tokens, d.finish_reason
                for e in reader.feed(d):
                    for data in items.add(e):
                        yield event(data)
            for data in items.close():
                yield event(data)
            final = head.response(items.done, finish, prompt, completion, cached)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield event({"type": kind, "response": final})
        except Exception as e:
            if gen.cancelled:
                return
            error = e if isinstance(e, APIError) else internal_error()
            body = error.body()["error"]
            yield event(
                {"type": "error", "code": body["code"], "message": body["message"], "param": body["param"]}
            )


class _Head:
    """The request's echo in every Response object."""

    def __init__(self, rid: str, created: int, model: str, req: ResponsesRequest, chat):
        self.rid, self.created, self.model, self.req, self.chat = rid, created, model, req, chat

    def response(
        self, output: list[dict], finish: str | None, prompt: int, completion: int, cached: int = 0
    ) -> dict:
        req = self.req
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": req.reasoning,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": None
            if finish is None
            else {
                "input_tokens": prompt,
                # cached: prompt tokens served by context reuse; trtedge has no separate cache write
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            },
        }


class _Items:
    """Output items built from reader events: one open at a time; ``add``/``close`` return the stream events
    and ``done`` holds the finished items."""

    def __init__(self, namespaces: dict[str, tuple[str, str]]):
        self.namespaces = namespaces  # prompt name -> (namespace, name) of namespaced functions
        self.done: list[dict] = []
        self.item: dict | None = None
        self.key: tuple | None = None

    def add(self, e: tuple) -> list[dict]:
        kind = e[0]
        out: list[dict] = []
        if kind == "reasoning":
            if self.key != ("reasoning",):
                out += self.close()
                out += self._open(
                    ("reasoning",), {"type": "reasoning", "id": _id("rs_"), "summary": [], "content": []}
                )
                self.text = ""
            self.text += e[1]
            out.append(
                {"type": "response.reasoning_text.delta", **self._where(), "content_index": 0, "delta": e[1]}
            )
        elif kind == "content":
            if self.key != ("message",) and not e[1].strip():
                return out  # layout around tool calls is not a message
            if self.key != ("message",):
                out += self.close()
                message = {
                    "type": "message",
                    "id": _id("msg_"),
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                out += self._open(("message",), message)
                self.text = ""
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(
                    {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part}
                )
            self.text += e[1]
            out.append(
                {
                    "type": "response.output_text.delta",
                    **self._where(),
                    "content_index": 0,
                    "delta": e[1],
                    "logprobs": [],
                }
            )
        elif kind == "call":
            out += self.close()
            call = {
                "type": "function_call",
                "id": _id("fc_"),
                "call_id": call_id(),
                "name": e[2],
                "arguments": "",
                "status": "in_progress",
            }
            if e[2] in self.namespaces:
                call["namespace"], call["name"] = self.namespaces[e[2]]
            out += self._open(("call", e[1]), call)
        elif self.key == ("call", e[1]):
            self.item["arguments"] += e[2]
            out.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": e[2]})
        return out

    def _open(self, key: tuple, item: dict) -> list[dict]:
        self.key, self.item = key, item
        return [{"type": "response.output_item.added", "output_index": len(self.done), "item": dict(item)}]

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.done)}

    def close(self) -> list[dict]:
        if self.item is None:
            return []
        item, where, out = self.item, self._where(), []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": self.text}]
            out.append(
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": self.text}
            )
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item["content"], item["status"] = [part], "completed"
            out.append(
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": self.text,
                    "logprobs": [],
                }
            )
            out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
        else:
            item["status"] = "completed"
            out.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        out.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": item})
        self.done.append(item)
        self.item = self.key = None
        return out


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
