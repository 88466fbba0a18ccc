"""Anthropic Messages request models (pydantic v2). Content blocks stay plain dicts here and are checked
one by one in the translation (serving.py), so that an error names the exact block."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trtedge.server.openai.protocol import INTEGRAL


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class AnthropicMessage(_Model):
    role: Literal["user", "assistant", "system"]  # system: a system turn mid-conversation
    content: str | list[dict[str, Any]]


class OutputFormat(_Model):
    """Structured output: the answer is JSON matching ``schema`` (served like OpenAI's response_format)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # -> reasoning effort
    format: OutputFormat | None = None


class _Conversation(_Model):
    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None  # accepted; the server keeps no context to edit
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the beta API's name for output_config.format


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1), INTEGRAL]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    metadata: dict[str, Any] | None = None
