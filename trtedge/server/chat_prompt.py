"""A chat request through the chat template: shared by /v1/chat/completions, /v1/messages and
/v1/responses (and /tokenize, /v1/messages/count_tokens).

Every chat surface turns its request into an OpenAI ``ChatCompletionRequest`` (messages, tools,
tool_choice, sampling); ``plan_chat`` checks its tools and messages, renders it through the chat
template into one engine request and picks the output parsers; ``ChoiceReader`` turns each choice's
deltas into reasoning, content and tool-call events that each surface writes in its own wire format."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from trtedge.llm import TemplateError
from trtedge.runtime.output import StreamDelta
from trtedge.server.errors import bad_request, not_supported
from trtedge.server.generation import Choice
from trtedge.server.multimodal import MEDIA_PARTS, Media, in_media_thread, load_media
from trtedge.server.openai.protocol import ChatCompletionRequest
from trtedge.server.parsers import (
    FORMATS,
    Format,
    OutputParser,
    reasoning_parser,
    tool_call_guide,
    tool_format,
)
from trtedge.server.parsers.reasoning import HARMONY
from trtedge.server.parsers.tool_prompt import renders_tools, with_tool_prompt

if TYPE_CHECKING:
    from trtedge.server.core import ServingCore

log = logging.getLogger("trtedge.server")

_TEXT_PARTS = ("text", "input_text", "output_text")


@dataclass
class ChatPlan:
    """One chat request ready for the engine, and how to read what comes back."""

    choices: list[Choice]
    prompt_text: str
    tool_format: Format | None = None  # None: tool calls are not parsed
    tools: dict[str, dict] = field(default_factory=dict)  # name -> JSON schema of the arguments
    reasoning: str | None = None
    opened: bool = False  # the prompt ends inside a <think> block
    parallel_tool_calls: bool = True

    def reader(self) -> ChoiceReader:
        return ChoiceReader(
            OutputParser(self.reasoning, self.tool_format, self.tools, self.opened), self.parallel_tool_calls
        )


class ChoiceReader:
    """One choice's deltas -> events ("reasoning", text), ("content", text), ("call", index, name),
    ("arguments", index, fragment); ``finish_reason`` says "tool_calls" once a call was made."""

    def __init__(self, parser: OutputParser, parallel: bool):
        self.parser = parser
        self.parallel = parallel
        self.num_calls = 0

    def feed(self, delta: StreamDelta) -> list[tuple]:
        events = self.parser.feed(delta.text, final=delta.finish_reason is not None)
        if not self.parallel:
            events = [e for e in events if e[0] not in ("call", "arguments") or e[1] == 0]
        self.num_calls += sum(1 for e in events if e[0] == "call")
        return events

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason


def call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Prompt:
    """A chat request rendered through the chat template."""

    text: str
    ids: list[int]
    tools: list[dict] | None
    tool_choice: str | dict
    template: str
    engine_prompt: Any = None  # what the engine is given: ``ids``, or a MultimodalPrompt with images
    tool_prompt: bool = False  # the tools went into the system prompt (the template shows none)

    def __post_init__(self) -> None:
        if self.engine_prompt is None:
            object.__setattr__(self, "engine_prompt", self.ids)


async def prepare_prompt(serving: ServingCore, req: ChatCompletionRequest) -> Prompt:
    """``render_prompt`` after loading the request's images and videos (off the event loop when any)."""
    media = await load_media(serving, req)
    if not media:
        return render_prompt(serving, req)
    return await in_media_thread(render_prompt, serving, req, media)


async def prepare_chat(
    serving: ServingCore, req: ChatCompletionRequest, guide: Any = None, salt: str | None = None
) -> ChatPlan:
    """``plan_chat`` after loading the request's images and videos (off the event loop when any)."""
    media = await load_media(serving, req)
    if not media:
        return plan_chat(serving, req, guide, salt)
    return await in_media_thread(plan_chat, serving, req, guide, salt, media)


def render_prompt(serving: ServingCore, req: ChatCompletionRequest, media: Media | None = None) -> Prompt:
    """Validate tools and tool_choice and render the conversation into prompt tokens; ``media`` holds
    the decoded media parts (see ``load_media``)."""
    llm = serving.llm
    tools = request_tools(req)
    choice = request_tool_choice(req, tools)
    template = serving.tokenizer_info.template_for(bool(tools))
    messages = template_messages(req, media or {})
    tool_prompt = bool(
        tools and req.apply_chat_template and not renders_tools(llm.apply_chat_template, template)
    )
    if tool_prompt:
        log.debug("the chat template renders no tools: %d tools go into the system prompt", len(tools))
        messages = with_tool_prompt(messages, tools)
    if req.apply_chat_template and not renders_system_turns(llm.apply_chat_template, template):
        messages = fold_system_messages(messages)
    options = dict(
        add_generation_prompt=req.add_generation_prompt,
        tools=None if tool_prompt else tools,
        enable_thinking=req.enable_thinking,
        reasoning_effort=req.reasoning_effort,
        chat_template_kwargs=req.chat_template_kwargs,
    )

    def render(messages: list[dict]) -> tuple[str, list[int], Any]:
        if not req.apply_chat_template:
            text = "\n".join(m.get("content") or "" for m in messages)
            return text, llm.tokenize(text) or serving.empty_prompt(), None
        if not media:
            rendered = llm.render_chat(messages, **options)
            return rendered.text, rendered.ids, None
        try:
            engine_prompt = llm.encode_prompt(messages, **options)
        except TemplateError:
            raise
        except ValueError as e:  # the vision processor refused a picture
            raise bad_request(str(e), param="messages", code="invalid_media") from None
        ids = list(engine_prompt.ids)
        return llm.detokenize(ids, skip_special_tokens=False), ids, engine_prompt

    try:
        try:
            text, ids, engine_prompt = render(messages)
        except TemplateError:
            folded = fold_system_messages(messages)
            if folded is messages:
                raise
            text, ids, engine_prompt = render(folded)  # the template refused system turns mid-way
    except (TemplateError, ValueError) as e:
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from None
    return Prompt(text, ids, tools, choice, template, engine_prompt, tool_prompt)


def plan_chat(
    serving: ServingCore,
    req: ChatCompletionRequest,
    guide: Any = None,
    salt: str | None = None,
    media: Media | None = None,
) -> ChatPlan:
    """Render the conversation and build the engine request and its output parsers; ``guide`` is the
    request's own structured-output guide (response_format), if any; ``salt`` its cache domain;
    ``media`` the decoded media parts."""
    config = serving.config
    prompt = render_prompt(serving, req, media)
    tools, choice = prompt.tools, prompt.tool_choice
    fmt = None
    if tools and choice != "none":
        fmt = (
            FORMATS["generic"]
            if prompt.tool_prompt
            else tool_format(config.tool_call_parser, prompt.template)
        )
    if choice == "auto" and not config.enable_auto_tool_choice:
        raise bad_request(
            'tool_choice "auto" (the default when tools are given) needs the server flag '
            '--enable-auto-tool-choice; or send tool_choice "none"',
            param="tool_choice",
        )
    if choice not in ("auto", "none"):
        tool_guide = tool_call_guide(tools, choice, fmt)
        if tool_guide is None:
            raise not_supported(
                f"tool_choice {json.dumps(choice)} with the {fmt.name} tool-call format", "tool_choice"
            )
        if guide is not None:
            raise bad_request(
                f"tool_choice {json.dumps(choice)} decides the output's shape: drop the structured-output "
                "field (response_format / guided_decoding)",
                param="tool_choice",
            )
        guide = tool_guide
    kwargs = dict(req.chat_template_kwargs or {})
    thinking = req.enable_thinking if req.enable_thinking is not None else kwargs.get("enable_thinking")
    max_tokens = req.max_completion_tokens or req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.params(req, len(prompt.ids), max_tokens, top, "messages", guide=guide, salt=salt)
    reasoning = reasoning_parser(config.reasoning_parser, prompt.template)
    if reasoning != HARMONY and thinking is not True:
        reasoning = (
            None  # <think> is split only when the request turns thinking on; harmony always has channels
        )
    harmony = reasoning == HARMONY or (fmt is not None and fmt.keep_special_tokens)
    if harmony and params.skip_special_tokens:
        params = replace(params, skip_special_tokens=False)
    return ChatPlan(
        choices=[Choice(prompt.engine_prompt, params)],
        prompt_text=prompt.text,
        tool_format=fmt,
        tools={t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()},
        reasoning=reasoning,
        opened=prompt.text.rstrip().endswith("<think>"),
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


def renders_system_turns(render, template: str) -> bool:
    """Whether ``template`` renders a system message after the first turn as it renders a system
    prompt (ChatML does); Gemma's folds its system prompt into the first user turn and has no system
    turn to show a later one in."""
    return _renders_system_turns(render, template)


@functools.lru_cache(maxsize=32)
def _renders_system_turns(render, template: str) -> bool:
    system, user = "trtedge-probe-system", "trtedge-probe-user"
    try:
        first = render([{"role": "system", "content": system}, {"role": "user", "content": user}])
        later = render([{"role": "user", "content": user}, {"role": "system", "content": system}])
    except Exception:  # refused: the TemplateError fallback merges them
        return False
    if system not in first or system not in later:
        return False
    head, tail = first[: first.index(system)], later[: later.index(system)]
    n = min(len(head), len(tail), 16)
    return n > 0 and head[-n:] == tail[-n:]


def fold_system_messages(messages: list[dict]) -> list[dict]:
    """``messages`` with every system message after the first turn merged into the leading system
    prompt, for templates that allow a system message only first; ``messages`` itself when none is."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later:
        return messages
    head = messages[0] if messages[0]["role"] == "system" else None
    texts = [_plain(m["content"]) for m in ([head] if head else []) + later]
    rest = [m for m in messages[1 if head else 0 :] if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _plain(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if p.get("type") == "text")


def request_tools(req: ChatCompletionRequest) -> list[dict] | None:
    tools = req.tools
    param = "tools"
    if tools is None and req.functions is not None:
        tools, param = [{"type": "function", "function": f} for f in req.functions], "functions"
    if not tools:
        return None
    for i, tool in enumerate(tools):
        where = f"{param}.{i}"
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(
                'only function tools are served: {"type": "function", "function": {...}}',
                param=f"{where}.type",
            )
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request("a function tool needs a name", param=f"{where}.function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request("parameters must be a JSON schema object", param=f"{where}.function.parameters")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", param=param)
    return tools


def request_tool_choice(req: ChatCompletionRequest, tools: list[dict] | None) -> str | dict:
    choice = req.tool_choice if req.tool_choice is not None else req.function_call
    param = "tool_choice" if req.tool_choice is not None else "function_call"
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request('tool_choice must be "none", "auto", "required" or a function', param=param)
        if choice != "none" and not tools:
            raise bad_request(f'tool_choice "{choice}" needs tools', param=param)
        return choice
    function = choice.get("function") if "function" in choice else choice
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}', param=param
        )
    if name not in [t["function"]["name"] for t in tools or ()]:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param=param)
    return {"type": "function", "function": {"name": name}}


def template_messages(req: ChatCompletionRequest, media: Media) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts: list[dict] = []
            for j, part in enumerate(content):
                if part.type in MEDIA_PARTS and (i, j) in media:
                    parts.append(media[i, j])
                    continue
                if part.type not in _TEXT_PARTS:
                    raise not_supported(f"{part.type!r} content", f"messages.{i}.content.{j}")
                if part.text is None:
                    raise bad_request("a text part needs 'text'", param=f"messages.{i}.content.{j}.text")
                parts.append({"type": "text", "text": part.text})
            if any(p["type"] != "text" for p in parts):
                content = parts
            else:
                content = "\n".join(p["text"] for p in parts)
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    "only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls"
                )
            message["tool_calls"] = [
                _template_call(c, f"messages.{i}.tool_calls.{k}") for k, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request("a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _template_call(call: dict, param: str) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("a tool call is {id, type: function, function: {name, arguments}}", param=param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise bad_request(
                "arguments must be a JSON object", param=f"{param}.function.arguments"
            ) from None
    # Chat templates read the arguments as a mapping (transformers' convention).
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
