"""OpenAI Responses request model (pydantic v2). Input items stay plain dicts here and are checked one by
one in the translation, so that an error names the exact item."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from trtedge.server.openai.protocol import INTEGRAL, Int


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    priority: Int = 0
