"""Conversation state and slash commands of `trtedge chat`: pure logic, no terminal."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from trtedge.chat.backends import TurnMetrics
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.text.streaming import ReasoningSplitter

TRANSCRIPT_FORMAT = "trtedge-chat/1"
CONTEXT_WARNING = 0.8  # warn once the conversation fills this share of the context
MAX_AUDIO_BYTES = 25 * 2**20  # one /audio file (the server's default --max-audio-bytes)

# name -> (arguments, one-line help); the order is the order of /help
COMMANDS: dict[str, tuple[str, str]] = {
    "help": ("", "show this help"),
    "system": ("[TEXT|none]", "show, set or remove the system message"),
    "clear": ("", "forget the conversation (keeps the system message and parameters)"),
    "retry": ("", "answer the last question again"),
    "params": (
        "[KEY=VALUE ...]",
        "show or change sampling parameters (temperature=0.7 max_tokens=256 seed=1)",
    ),
    "think": ("[on|off]", "show or hide the model's <think> reasoning"),
    "audio": ("PATH|none", "send an audio file (wav, flac, mp3, ogg, m4a, webm) with the next message"),
    "speak": ("[on|off]", "speak each answer aloud (a model with speech output, e.g. Qwen3-Omni)"),
    "save-audio": ("PATH", "write the last answer's speech as a WAV file"),
    "stats": ("", "totals of this session"),
    "save": ("FILE", "write the conversation as a JSON transcript"),
    "load": ("FILE", "read a conversation saved with /save (or a JSON list of messages)"),
    "model": ("", "show the model, bundle and device"),
    "exit": ("", "leave (also Ctrl-D, or Ctrl-C twice)"),
}

# the SamplingParams fields a user may set with /params, and how to read their values
PARAM_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
)


@dataclass
class CommandResult:
    """What a command did. ``action`` asks the terminal side for something the session cannot do
    itself: "exit", "retry" (send the conversation again), "model" (describe the backend), "stats"."""

    message: str = ""
    error: bool = False
    action: str | None = None
    argument: str = ""  # what the action needs ("save-audio": the path)


@dataclass
class SessionTotals:
    turns: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_time: float = 0.0  # seconds spent after the first token, for the mean decode rate
    decoded_tokens: int = 0
    ttft_sum: float = 0.0
    latency_sum: float = 0.0
    started: float = field(default_factory=time.monotonic)


class ChatSession:
    """The conversation (system message + user/assistant turns), sampling parameters and totals."""

    def __init__(
        self,
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        max_context: int | None = None,
        show_thinking: bool = False,
    ):
        self.params = params or SamplingParams()
        self.system = system or None
        self.messages: list[dict] = []
        self.max_context = max_context
        self.show_thinking = show_thinking
        self.totals = SessionTotals()
        self.context_tokens = 0  # prompt + answer tokens of the last turn: what the conversation occupies
        self.attachments: list[dict] = []  # /audio parts that go with the next user message
        self.speak = False  # /speak on: each answer is spoken after it is shown
        self.last_audio = None  # the last answer's speech (float32, 24 kHz), once made

    # ---- conversation ---------------------------------------------------------------------------
    def conversation(self) -> list[dict]:
        """The messages to send: the system message (if any), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    def add_user(self, text: str) -> None:
        """A user turn; files attached with /audio go with it (OpenAI input_audio parts, then the text)."""
        if self.attachments:
            content = [*self.attachments, {"type": "text", "text": text}]
            self.attachments = []
            self.messages.append({"role": "user", "content": content})
            return
        self.messages.append({"role": "user", "content": text})

    def add_answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.last_audio = None

    def last_answer(self) -> str | None:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), None)

    def drop_unanswered(self) -> None:
        """Forget a question whose answer failed or came back empty."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def prepare_retry(self) -> str | None:
        """Drop the last answer so that the conversation ends with the question again; an error or None."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            return "nothing to retry: ask something first"
        return None

    def record(self, m: TurnMetrics) -> None:
        t = self.totals
        t.turns += 1
        t.cancelled += m.finish_reason == "cancelled"
        t.prompt_tokens += m.prompt_tokens
        t.generated_tokens += m.generated_tokens
        decoded = max(m.generated_tokens - 1, 0)
        if m.decode_tokens_per_second > 0 and decoded:
            t.decoded_tokens += decoded
            t.decode_time += decoded / m.decode_tokens_per_second
        t.ttft_sum += m.time_to_first_token
        t.latency_sum += m.latency
        self.context_tokens = m.prompt_tokens + m.generated_tokens

    # ---- commands -------------------------------------------------------------------------------
    def execute(self, line: str) -> CommandResult:
        """Run one slash command (``line`` starts with "/")."""
        name, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        name = name.lower()
        if name in ("quit", "q"):
            name = "exit"
        if name not in COMMANDS:
            matches = [c for c in COMMANDS if c.startswith(name)] if name else []
            if len(matches) != 1:
                return CommandResult(f"unknown command /{name}; /help lists them", error=True)
            name = matches[0]
        return getattr(self, f"_cmd_{name.replace('-', '_')}")(arg)

    def _cmd_help(self, arg: str) -> CommandResult:
        return CommandResult(help_text())

    def _cmd_system(self, arg: str) -> CommandResult:
        if not arg:
            if self.system is None:
                return CommandResult("no system message (/system TEXT sets one)")
            return CommandResult(f"system: {self.system}")
        if arg.lower() == "none":
            self.system = None
            return CommandResult("system message removed")
        self.system = arg
        return CommandResult("system message set; it applies from the next answer on")

    def _cmd_clear(self, arg: str) -> CommandResult:
        n = len(self.messages)
        self.messages.clear()
        self.context_tokens = 0
        return CommandResult(f"conversation cleared ({n} message{'s' * (n != 1)} forgotten)")

    def _cmd_retry(self, arg: str) -> CommandResult:
        error = self.prepare_retry()
        if error:
            return CommandResult(error, error=True)
        return CommandResult(action="retry")

    def _cmd_params(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult(format_params(self.params))
        try:
            self.params = update_params(self.params, arg)
        except ValueError as e:
            return CommandResult(f"/params: {e}", error=True)
        return CommandResult(format_params(self.params))

    def _cmd_think(self, arg: str) -> CommandResult:
        value = arg.lower()
        if value in ("on", "off"):
            self.show_thinking = value == "on"
        elif value:
            return CommandResult("/think takes on or off", error=True)
        state = "shown (dimmed)" if self.show_thinking else "collapsed to one line"
        return CommandResult(f"reasoning is {state}")

    def _cmd_audio(self, arg: str) -> CommandResult:
        if not arg:
            n = len(self.attachments)
            return CommandResult(
                f"{n} audio file{'s' * (n != 1)} attached (/audio PATH adds one, /audio none drops them)"
            )
        if arg.lower() == "none":
            self.attachments = []
            return CommandResult("audio attachments dropped")
        try:
            part = audio_part(Path(arg).expanduser())
        except (OSError, ValueError) as e:
            return CommandResult(f"/audio: {e}", error=True)
        self.attachments.append(part)
        return CommandResult(f"attached {arg}; it goes with your next message")

    def _cmd_speak(self, arg: str) -> CommandResult:
        value = arg.lower()
        if value in ("on", "off"):
            self.speak = value == "on"
        elif value:
            return CommandResult("/speak takes on or off", error=True)
        return CommandResult(f"answers are {'spoken' if self.speak else 'not spoken'}")

    def _cmd_save_audio(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult("/save-audio needs a file name", error=True)
        if self.last_answer() is None:
            return CommandResult("/save-audio: no answer yet", error=True)
        return CommandResult(action="save-audio", argument=arg)

    def _cmd_stats(self, arg: str) -> CommandResult:
        return CommandResult(
            format_totals(self.totals, self.context_tokens, self.max_context), action="stats"
        )

    def _cmd_save(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult("/save needs a file name", error=True)
        path = Path(arg).expanduser()
        try:
            path.write_text(json.dumps(self.transcript(), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            return CommandResult(f"/save: {e}", error=True)
        return CommandResult(f"saved {len(self.messages)} messages to {path}")

    def _cmd_load(self, arg: str) -> CommandResult:
        if not arg:
            return CommandResult("/load needs a file name", error=True)
        path = Path(arg).expanduser()
        try:
            self.load_transcript(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            return CommandResult(f"/load: {e}", error=True)
        return CommandResult(f"loaded {len(self.messages)} messages from {path}")

    def _cmd_model(self, arg: str) -> CommandResult:
        return CommandResult(action="model")

    def _cmd_exit(self, arg: str) -> CommandResult:
        return CommandResult(action="exit")

    # ---- transcripts ----------------------------------------------------------------------------
    def transcript(self) -> dict:
        return {
            "format": TRANSCRIPT_FORMAT,
            "params": _params_dict(self.params),
            "messages": self.conversation(),
        }

    def load_transcript(self, data) -> None:
        """Take a /save transcript or a plain OpenAI-style list of messages; ValueError if malformed."""
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list):
            raise ValueError("expected a /save transcript or a JSON list of messages")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), (str, list))
                or isinstance(m["content"], list)
                and (m["role"] != "user" or not all(isinstance(p, dict) for p in m["content"]))
            ):
                raise ValueError(f"message {i} is not a {{'role': system|user|assistant, 'content': str}}")
        params = self.params
        if isinstance(data, dict) and isinstance(data.get("params"), dict):
            params = _build_params(data["params"])
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        turns = messages[1:] if system is not None else messages
        if any(m["role"] == "system" for m in turns):
            raise ValueError("a system message may only come first")
        self.params = params
        self.system = system
        self.messages = [{"role": m["role"], "content": m["content"]} for m in turns]
        self.context_tokens = 0


def audio_part(path: Path) -> dict:
    """An OpenAI input_audio part of the file at ``path``; ValueError for a file trtedge cannot read."""
    import base64

    from trtedge.runtime.multimodal.audio_file import sniff_format

    size = path.stat().st_size
    if size > MAX_AUDIO_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than {MAX_AUDIO_BYTES}")
    data = path.read_bytes()
    demuxer = sniff_format(data)
    if demuxer is None:
        raise ValueError(f"{path} is not a wav, flac, mp3, ogg, m4a or webm file")
    fmt = {"mp4": "m4a", "matroska": "webm"}.get(demuxer, demuxer)
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


# ---- parameters ---------------------------------------------------------------------------------
def update_params(params: SamplingParams, text: str) -> SamplingParams:
    """``params`` with ``key=value`` pairs applied, validated by SamplingParams (ValueError names the key)."""
    changes = {}
    for item in text.split():
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        if key not in PARAM_KEYS:
            raise ValueError(f"unknown parameter {key!r}; one of {', '.join(PARAM_KEYS)}")
        changes[key] = _parse_value(key, raw)
    return _build_params({**_params_dict(params), **changes})


def _parse_value(key: str, raw: str):
    if raw.lower() in ("none", "null", ""):
        if key in ("seed", "stop"):
            return None
        raise ValueError(f"{key} needs a value")
    if key == "stop":
        return raw.encode().decode("unicode_escape")
    try:
        number = float(raw)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if key in ("max_tokens", "top_k", "seed"):
        if not number.is_integer() or not raw.lstrip("+-").isdigit():
            raise ValueError(f"{key} must be an integer, got {raw!r}")
        return int(raw)
    return number


def _build_params(values: dict) -> SamplingParams:
    values = {k: v for k, v in values.items() if k in PARAM_KEYS}
    if "stop" in values:
        stop = values["stop"]
        values["stop"] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    return SamplingParams(**values)


def _params_dict(params: SamplingParams) -> dict:
    values = {k: getattr(params, k) for k in PARAM_KEYS}
    values["stop"] = list(values["stop"])
    return values


def format_params(params: SamplingParams) -> str:
    defaults = SamplingParams()
    parts = []
    for key in PARAM_KEYS:
        value = getattr(params, key)
        if key in ("max_tokens", "temperature", "seed") or value != getattr(defaults, key):
            shown = "none" if value is None else list(value) if isinstance(value, tuple) else value
            parts.append(f"{key}={shown}")
    return "params: " + " ".join(parts)


# ---- formatting ---------------------------------------------------------------------------------
def help_text() -> str:
    width = max(len(f"/{n} {a}".strip()) for n, (a, _) in COMMANDS.items())
    lines = [f"  {f'/{n} {a}'.strip():<{width}}  {h}" for n, (a, h) in COMMANDS.items()]
    keys = [
        "Enter sends; Alt-Enter (or Esc Enter) starts a new line; pasted text keeps its lines.",
        "Ctrl-C stops an answer; at the prompt, Ctrl-C twice or Ctrl-D leaves. Tab completes commands.",
    ]
    return "\n".join(["commands:", *lines, *keys])


def context_fraction(tokens: int, max_context: int | None) -> float | None:
    return tokens / max_context if max_context else None


def format_context(tokens: int, max_context: int | None) -> str:
    if not max_context:
        return f"context {tokens} tokens"
    return f"context {tokens}/{max_context} ({100 * tokens / max_context:.0f}%)"


def context_warning(tokens: int, max_context: int | None) -> str | None:
    """A warning once the conversation nears the context limit, else None."""
    fraction = context_fraction(tokens, max_context)
    if fraction is None or fraction < CONTEXT_WARNING:
        return None
    left = max(max_context - tokens, 0)
    return f"context nearly full: {left} tokens left; answers will be cut short (/clear starts over)"


def format_metrics(m: TurnMetrics, max_context: int | None) -> str:
    """The one status line after an answer."""
    parts = [
        f"TTFT {_seconds(m.time_to_first_token)}",
        f"{m.decode_tokens_per_second:.1f} tok/s",
        f"{m.generated_tokens} tokens",
        f"latency {_seconds(m.latency)}",
        format_context(m.prompt_tokens + m.generated_tokens, max_context),
    ]
    if m.reused_tokens:
        parts.append(f"reused {m.reused_tokens}")
    if m.finish_reason == "cancelled":
        parts.append("cancelled")
    elif m.finish_reason == "length":
        parts.append("cut at max_tokens")
    return " · ".join(parts)


def format_totals(t: SessionTotals, context_tokens: int, max_context: int | None) -> str:
    answered = max(t.turns, 1)
    rate = t.decoded_tokens / t.decode_time if t.decode_time > 0 else 0.0
    rows = [
        ("answers", f"{t.turns} ({t.cancelled} cancelled)"),
        ("prompt tokens", str(t.prompt_tokens)),
        ("generated tokens", str(t.generated_tokens)),
        ("mean TTFT", _seconds(t.ttft_sum / answered) if t.turns else "-"),
        ("mean decode", f"{rate:.1f} tok/s" if rate else "-"),
        ("generation time", _seconds(t.latency_sum)),
        ("session time", _seconds(time.monotonic() - t.started)),
        ("context now", format_context(context_tokens, max_context).removeprefix("context ")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


class ThinkSplitter(ReasoningSplitter):
    """Splits streamed text into reasoning (inside ``<think>...</think>``, every such block) and answer
    pieces, whatever the deltas' boundaries: the server parsers' splitter, for any server's text."""

    def __init__(self) -> None:
        super().__init__(every_block=True)


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


__all__ = [
    "COMMANDS",
    "ChatSession",
    "CommandResult",
    "SessionTotals",
    "ThinkSplitter",
    "format_metrics",
    "update_params",
]
