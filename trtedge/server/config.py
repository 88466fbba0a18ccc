"""ServeConfig: the validated settings of `trtedge serve` that are the server's own (the engine's
settings live in LaunchConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trtedge.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MAX_BODY_BYTES = 16 * 1024 * 1024


class ServerConfigError(ValueError):
    """A server flag is invalid; the message names the flag."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything `trtedge serve` needs besides the engine's LaunchConfig. Bad values raise
    ``ServerConfigError`` naming the flag."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    enable_auto_tool_choice: bool = False
    max_queued_requests: int = 16
    queue_timeout: float = 600.0
    allowed_local_media_path: str | None = None
    log_level: str = "info"
    engine_cache_max_size_gb: float | None = None
    clear_engine_cache: bool = False
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ServerConfigError(f"--host must be a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ServerConfigError(f"--port must be an integer in [0, 65535], got {self.port!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ServerConfigError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ServerConfigError("--api-key (or TRTEDGE_API_KEY) must not be empty")
        _choice("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS)
        _choice("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        q = self.max_queued_requests
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ServerConfigError(f"--max-queued-requests must be a non-negative integer, got {q!r}")
        t = self.queue_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ServerConfigError(f"--queue-timeout must be a positive number of seconds, got {t!r}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ServerConfigError(
                f"--allowed-local-media-path must be an existing directory, got {self.allowed_local_media_path!r}"
            )
        _choice("--log-level", self.log_level, LOG_LEVELS)
        gb = self.engine_cache_max_size_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
            raise ServerConfigError(f"--engine-cache-max-size-gb must be a positive number, got {gb!r}")

    @classmethod
    def from_env(cls, **kwargs) -> ServeConfig:
        """Like the constructor; ``api_key`` falls back to ``$TRTEDGE_API_KEY``."""
        if kwargs.get("api_key") is None and os.environ.get("TRTEDGE_API_KEY"):
            kwargs["api_key"] = os.environ["TRTEDGE_API_KEY"]
        return cls(**kwargs)


def _choice(flag: str, value: str | None, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise ServerConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
