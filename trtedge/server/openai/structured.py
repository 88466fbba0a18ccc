"""Structured-output request fields (``response_format``, ``guided_decoding`` and vLLM's ``guided_*``) and
their translation into one ``GuidedDecodingParams``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trtedge.runtime.sampling_params import GuidedDecodingParams
from trtedge.server.errors import bad_request

_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "ebnf",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class GuidedDecoding(_Strict):
    """Exactly one guide: ``json`` (a JSON schema), ``json_object``, ``regex``, ``ebnf`` (also named
    ``grammar``), ``structural_tag`` or ``choice``; ``jump_forward`` appends grammar-forced tokens with
    fewer model passes (same output)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    ebnf: str | None = Field(default=None, alias="grammar")
    structural_tag: dict[str, Any] | str | None = None
    choice: list[str] | None = None
    strict: bool = True
    jump_forward: bool = False

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


def guide_from_request(req) -> tuple[GuidedDecodingParams | None, str | None]:
    """(guide, field) for the structured-output field a request sets; 400 when several are set or the guide
    is malformed."""
    fmt = req.response_format
    sources = []
    if fmt is not None and fmt.type != "text":
        sources.append("response_format")
    for name in ("guided_decoding", "structured_outputs", *_LEGACY):
        if getattr(req, name, None) is not None:
            sources.append(name)
    if len(sources) > 1:
        raise bad_request(
            f"set only one of {' and '.join(sources)}: each asks for structured output", param=sources[1]
        )
    if not sources:
        return None, None
    source = sources[0]
    try:
        return _guide(req, source), source
    except ValueError as e:
        raise bad_request(str(e), param=source) from None


def _guide(req, source: str) -> GuidedDecodingParams:
    if source == "response_format":
        return _from_response_format(req.response_format)
    if source in _LEGACY:
        return GuidedDecodingParams(**{_LEGACY[source]: getattr(req, source)})
    fields = getattr(req, source).model_dump(exclude_none=True)
    fields["json_object"] = bool(fields.get("json_object"))
    if "json_" in fields:
        fields["json"] = fields.pop("json_")
    return GuidedDecodingParams(**fields)


def _from_response_format(fmt: ResponseFormat) -> GuidedDecodingParams:
    if fmt.type == "json_object":
        return GuidedDecodingParams(json_object=True)
    if fmt.json_schema is None:
        raise ValueError("response_format of type json_schema needs json_schema: {name, schema, strict}")
    return GuidedDecodingParams(json=fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))
