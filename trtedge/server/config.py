"""ServeConfig: the validated settings of `trtedge serve` that are the server's own (the engine's
settings live in LaunchConfig)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from trtedge.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MAX_BODY_BYTES = 16 * 1024 * 1024
HEADER_TIMEOUT = 10.0  # seconds a client has to send a request's headers (slowloris)
BODY_TIMEOUT = 60.0  # seconds a client has to send a request's body
KEEP_ALIVE_TIMEOUT = 5.0  # seconds an idle keep-alive connection stays open


class ServerConfigError(ValueError):
    """A server flag is invalid; the message names the flag."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything `trtedge serve` needs besides the engine's LaunchConfig. Bad values raise
    ``ServerConfigError`` naming the flag."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    api_keys: dict[str, str] | None = field(default=None, repr=False)  # tenant -> key (from api_key_file)
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    enable_auto_tool_choice: bool = False
    max_queued_requests: int = 16
    queue_timeout: float = 600.0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    max_media_bytes: int = 20 * 2**20
    media_fetch_timeout: float = 10.0
    max_video_frames: int = 32
    max_image_tokens: int | None = None
    max_image_tokens_per_image: int | None = None
    max_audio_bytes: int = 25 * 2**20  # one uploaded or inlined audio file (OpenAI's upload limit)
    max_audio_seconds: float = 600.0  # one audio clip's duration
    log_level: str = "info"
    engine_cache_max_size_gb: float | None = None
    clear_engine_cache: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    override_generation_config: str | None = None  # JSON: sampling defaults for requests that omit them
    generation_defaults: dict = field(default_factory=dict, init=False, repr=False)  # parsed from it

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ServerConfigError(f"--host must be a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ServerConfigError(f"--port must be an integer in [0, 65535], got {self.port!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ServerConfigError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ServerConfigError("--api-key (or TRTEDGE_API_KEY) must not be empty")
        if self.api_key_file is not None and self.api_keys is None:
            object.__setattr__(self, "api_keys", load_api_keys(self.api_key_file))
        if self.api_keys is not None:
            _check_api_keys(self.api_keys, self.api_key)
        _choice("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS)
        _choice("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        q = self.max_queued_requests
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ServerConfigError(f"--max-queued-requests must be a non-negative integer, got {q!r}")
        _positive_seconds("--queue-timeout", self.queue_timeout)
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ServerConfigError(
                f"--allowed-local-media-path must be an existing directory, got {self.allowed_local_media_path!r}"
            )
        _positive_int("--max-media-bytes", self.max_media_bytes)
        _positive_seconds("--media-fetch-timeout", self.media_fetch_timeout)
        _positive_int("--max-video-frames", self.max_video_frames)
        _positive_int("--max-image-tokens", self.max_image_tokens, optional=True)
        _positive_int("--max-image-tokens-per-image", self.max_image_tokens_per_image, optional=True)
        _positive_int("--max-audio-bytes", self.max_audio_bytes)
        _positive_seconds("--max-audio-seconds", self.max_audio_seconds)
        _choice("--log-level", self.log_level, LOG_LEVELS)
        gb = self.engine_cache_max_size_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
            raise ServerConfigError(f"--engine-cache-max-size-gb must be a positive number, got {gb!r}")
        object.__setattr__(self, "generation_defaults", _generation_defaults(self.override_generation_config))

    @classmethod
    def from_env(cls, **kwargs) -> ServeConfig:
        """Like the constructor; ``api_key`` falls back to ``$TRTEDGE_API_KEY``."""
        if kwargs.get("api_key") is None and os.environ.get("TRTEDGE_API_KEY"):
            kwargs["api_key"] = os.environ["TRTEDGE_API_KEY"]
        return cls(**kwargs)


def load_api_keys(path: str) -> dict[str, str]:
    """--api-key-file: a JSON object of tenant name -> API key."""
    flag = "--api-key-file"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ServerConfigError(f"{flag}: cannot read {path!r} ({e.strerror})") from None
    except ValueError as e:
        raise ServerConfigError(f"{flag}: {path!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ServerConfigError(f'{flag}: {path!r} must hold a JSON object {{"tenant": "key", ...}}')
    return data


def _check_api_keys(keys: dict, api_key: str | None) -> None:
    flag = "--api-key-file"
    if not keys:
        raise ServerConfigError(f"{flag}: the key map is empty")
    for name, key in keys.items():
        if not isinstance(name, str) or not name or not isinstance(key, str) or not key:
            raise ServerConfigError(f"{flag}: tenant {name!r} needs a non-empty string key")
    if len(set(keys.values())) != len(keys) or api_key in keys.values():
        raise ServerConfigError(f"{flag}: two tenants (or --api-key and a tenant) share a key")


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _generation_defaults(text: str | None) -> dict:
    """--override-generation-config (vLLM's flag): a JSON object of sampling defaults, used where a
    request does not set the field; ``max_new_tokens`` is the default max_tokens."""
    flag = "--override-generation-config"
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ServerConfigError(f"{flag} must be a JSON object ({e})") from None
    if not isinstance(data, dict):
        raise ServerConfigError(f'{flag} must be a JSON object, e.g. {{"temperature": 0}}')
    for key, value in data.items():
        if key not in GENERATION_KEYS:
            raise ServerConfigError(f"{flag}: unknown key {key!r} (known: {', '.join(GENERATION_KEYS)})")
        integer = key in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ServerConfigError(f"{flag}: {key} must be {'an integer' if integer else 'a number'}")
    if data.get("max_new_tokens", 1) < 1:
        raise ServerConfigError(f"{flag}: max_new_tokens must be a positive integer")
    return data


def _choice(flag: str, value: str | None, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise ServerConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")


def _positive_int(flag: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServerConfigError(f"{flag} must be a positive integer, got {value!r}")


def _positive_seconds(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ServerConfigError(f"{flag} must be a positive number of seconds, got {value!r}")
