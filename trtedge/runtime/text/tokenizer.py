from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from trtedge.runtime.text.byte_level import piece_bytes

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_NO_TEMPLATE = (
    "This model has no chat template; send a preformatted prompt instead (apply_chat_template=False)."
)
# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens kept as decoding context.
_PROMPT_CONTEXT = 5


class TemplateError(ValueError):
    """A chat template failed to render; carries the template's own message for raise_exception()."""


class Tokenizer:
    """A `tokenizers` tokenizer plus the Hugging Face config around it (special tokens, chat template)."""

    def __init__(
        self,
        tokenizer_json: str,
        tokenizer_config: dict | None,
        chat_template: str | list[dict] | dict[str, str] | None = None,
        generation_config: dict | None = None,
    ) -> None:
        config = dict(tokenizer_config or {})
        self._backend = _BackendTokenizer.from_str(tokenizer_json)
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {
            key: token
            for key in _SPECIAL_TOKEN_KEYS
            if (token := _token_content(config.get(key))) is not None
        }
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids: frozenset[int] = self._eos_ids(generation_config or {})
        if "add_bos_token" in config:
            self.add_bos_token: bool = bool(config["add_bos_token"])
        else:
            self.add_bos_token = _adds_bos(_component(self._backend.post_processor), self.bos_token)
        if chat_template is None:
            chat_template = config.get("chat_template")
        self.chat_templates: dict[str, str] = _template_dict(chat_template)
        self.chat_template: str | None = self.chat_templates.get("default")
        added = self._backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        self._byte_token_ids = self._find_byte_tokens()

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json plus the optional configs and chat template files of a model directory."""
        root = Path(path)
        config = {
            key: value
            for key, value in (_read_json(root / "special_tokens_map.json") or {}).items()
            if key in _SPECIAL_TOKEN_KEYS
        }
        config.update(_read_json(root / "tokenizer_config.json") or {})
        return cls(
            (root / "tokenizer.json").read_text(encoding="utf-8"),
            config,
            _read_chat_template(root),
            _read_json(root / "generation_config.json"),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended once when the model wants it."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(int(i)) if int(i) >= 0 else None

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for: its byte-level BPE spelling undone, else the UTF-8 of its
        text (a special token, a SentencePiece piece)."""
        raw = piece_bytes(self.id_to_token(i) or "")
        return raw if raw is not None else self.decode([i], skip_special_tokens=False).encode()

    def token_to_id(self, t: str) -> int | None:
        return self._backend.token_to_id(t)

    def get_vocab(self) -> dict[str, int]:
        """Token (in the tokenizer's own encoding, e.g. byte-level) -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text of the backend tokenizer."""
        return self._backend.to_str()

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """Render the chat template like transformers' apply_chat_template(tokenize=False).

        Precedence of template variables, lowest first: special tokens, chat_template_kwargs,
        enable_thinking/reasoning_effort (when not None), then messages/tools/add_generation_prompt.
        """
        template = _compile(self._select_template(tools))
        context: dict[str, Any] = {"documents": None, **self.special_tokens, **(chat_template_kwargs or {})}
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        if reasoning_effort is not None:
            context["reasoning_effort"] = reasoning_effort
        context.update(
            messages=_normalize_messages(messages), tools=tools, add_generation_prompt=add_generation_prompt
        )
        return _render(template, context)

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """apply_chat_template (same keywords) then encode without adding BOS: the template adds it if wanted."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def _select_template(self, tools: list[dict] | None) -> str:
        templates = self.chat_templates
        if not templates:
            raise TemplateError(_NO_TEMPLATE)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise TemplateError(
            f"The model has several chat templates ({', '.join(templates)}) and none is 'default'."
        )

    def _eos_ids(self, generation_config: dict) -> frozenset[int]:
        ids = set()
        if self.eos_token is not None and (eos := self.token_to_id(self.eos_token)) is not None:
            ids.add(eos)
        configured = generation_config.get("eos_token_id")
        if isinstance(configured, int):
            configured = [configured]
        ids.update(int(i) for i in configured or () if i is not None)
        return frozenset(ids)

    def _find_byte_tokens(self) -> frozenset[int]:
        if not _has_type(_component(self._backend.decoder), "ByteFallback"):
            return frozenset()
        ids = (self.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; never emits a partial UTF-8 character (U+FFFD from an
    incomplete byte sequence) and the concatenated deltas (plus flush()) equal the decoded output exactly.

    Each step decodes only a short window (vLLM/TGI prefix/read offsets). Without prompt_ids, ''.join(deltas) + flush() == tokenizer.decode(token_ids, skip_special_tokens).
    With prompt_ids, the last prompt tokens are decoding context (as in vLLM), so the result is the text the
    output appends to the prompt: decode(prompt_ids + token_ids)[len(decode(prompt_ids)):]. The two differ for
    SentencePiece-style decoders, which drop the leading space of the first token they decode.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = _prompt_context(tokenizer, [int(i) for i in prompt_ids or ()], skip_special_tokens)
        self._in_byte_run = False
        self.token_ids: list[int] = []
        self._pieces: list[str] = []
        # Text of _ids[_prefix:_read] is already accounted for; _ids[_read:] is held back.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode_window(self._read)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Append one output token; returns the newly completed text, possibly ''."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        if not (self._skip_special and token_id in self._tokenizer.special_token_ids):
            self._in_byte_run = token_id in self._tokenizer._byte_token_ids
        # ByteFallback decodes a run of byte tokens all-or-nothing: a later invalid byte turns the whole run,
        # including characters that were already complete, into U+FFFD. So a run is only emitted once it ends.
        if self._in_byte_run:
            return ""
        text = self._decode_window(len(self._ids))
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emit whatever is still held back; call once the output is complete."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode_window(len(self._ids)))

    def _emit(self, text: str) -> str:
        # The window restarts where the emitted text ended. Decoders that strip a leading space from the first
        # token (Metaspace, Strip) do so in both the prefix and the window decode, so the subtraction cancels it.
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode_window(self._read)
        self._pieces.append(delta)
        return delta

    def _decode_window(self, end: int) -> str:
        return self._tokenizer._backend.decode(
            self._ids[self._prefix : end], skip_special_tokens=self._skip_special
        )


def _prompt_context(tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    hidden = tokenizer.special_token_ids if skip_special_tokens else frozenset()
    start = max(len(prompt_ids) - _PROMPT_CONTEXT, 0)
    # The context must not start inside a ByteFallback run (whose text depends on all of its bytes) and must
    # hold a visible token, or a SentencePiece decoder would strip the first output token's leading space.
    while start > 0 and (
        prompt_ids[start] in tokenizer._byte_token_ids or all(i in hidden for i in prompt_ids[start:])
    ):
        start -= 1
    return prompt_ids[start:]


class _GenerationTag(jinja2.ext.Extension):
    # transformers' {% generation %} marks assistant tokens for training masks; rendering just keeps the body.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_MAX_TEMPLATE_VALUE = 1_000_000  # longest string or list a template may build with * (and widest **)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The jinja2 sandbox (no attribute access to Python internals, no mutation, no file loader), also
    refusing ``*`` and ``**`` results big enough to exhaust memory or CPU."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    if len(seq) * times > _MAX_TEMPLATE_VALUE:
                        raise jinja2.sandbox.SecurityError("the template builds a value too large")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 256:
            raise jinja2.sandbox.SecurityError("the template raises to a power too large")
        return super().call_binop(context, operator, left, right)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"Invalid chat template: {exc}") from exc


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    try:
        return template.render(**context)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(str(exc)) from exc
    except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
        raise TemplateError(f"Chat template failed: {type(exc).__name__}: {exc}") from exc


def _normalize_messages(messages: list[dict]) -> list[dict]:
    # Like transformers: keys set to None are dropped (OpenAI clients send content=None), and reasoning given
    # under any of its names is exposed as both `reasoning_content` and `thinking`.
    if not messages:
        raise TemplateError("Cannot apply the chat template to an empty conversation.")
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TemplateError(f"Chat messages must be dicts, got {type(message).__name__}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _template_dict(value: str | list[dict] | dict[str, str] | None) -> dict[str, str]:
    if not value:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, dict):
        return dict(value)
    return {item["name"]: item["template"] for item in value}


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _read_chat_template(root: Path) -> dict[str, str] | None:
    templates: dict[str, str] = {}
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    elif (legacy := _read_json(root / "chat_template.json")) and legacy.get("chat_template"):
        templates.update(_template_dict(legacy["chat_template"]))
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return templates or None


def _component(component: Any) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _has_type(spec: dict | None, type_name: str) -> bool:
    if not spec:
        return False
    children = spec.get("decoders") or spec.get("processors") or ()
    return spec.get("type") == type_name or any(_has_type(child, type_name) for child in children)


def _adds_bos(post_processor: dict | None, bos_token: str | None) -> bool:
    if not post_processor or bos_token is None:
        return False
    if post_processor.get("type") == "Sequence":
        return any(_adds_bos(child, bos_token) for child in post_processor.get("processors", ()))
    if post_processor.get("type") != "TemplateProcessing":
        return False
    first = (post_processor.get("single") or [{}])[0]
    return first.get("SpecialToken", {}).get("id") == bos_token
