#!/usr/bin/env python3
"""Write docs/http-reference.md from the server's pydantic request models (their JSON schema): every
field of every POST endpoint with its type, constraints and default, and example bodies that are
validated against the same models, so the page cannot drift. With --check, only say whether the page
is current (exit 1 when stale); the tests run it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "http-reference.md"
# Responses the server gave to EXAMPLES (sent with "stream": false) and to the GET endpoints, as
# captured from `trtedge serve` with the embedded model; tests/e2e/test_http_examples.py checks
# that a live server still answers with the same structure.
RESPONSES = Path(__file__).resolve().parent / "http_response_examples.json"
HEADER = """# HTTP reference

Generated from the request models of `trtedge serve` by `scripts/generate_http_reference.py`; do not
edit by hand. [HTTP server](server.md) explains the behaviour: streaming, admission and 429,
errors, authentication, metrics. Unknown fields are accepted and ignored (logged); a field whose
feature is not available is refused with a 400 naming it.

| method | path | body |
| --- | --- | --- |
| GET, HEAD | `/` | none (a short plain-text 200: clients probe the base URL) |
| GET | `/health`, `/health/ready` | none |
| GET | `/metrics` | none (Prometheus text) |
| GET | `/openapi.json` | none (the OpenAPI 3.1 document generated from these models) |
| GET | `/v1/models`, `/v1/models/{model}` | none |
| POST | `/v1/chat/completions` | [chat completion request](#post-v1chatcompletions) |
| POST | `/v1/completions` | [completion request](#post-v1completions) |
| POST | `/v1/responses` | [responses request](#post-v1responses) |
| POST | `/v1/messages` | [Anthropic messages request](#post-v1messages) |
| POST | `/v1/messages/count_tokens` | [Anthropic token count request](#post-v1messagescount_tokens) |
| POST | `/v1/audio/transcriptions` | [multipart form](#post-v1audiotranscriptions) (OpenAI's; see [Audio](audio.md)) |
| POST | `/v1/audio/speech` | a speech request (OpenAI's; fields and formats in [Speech output](speech.md)) |
| GET | `/v1/voices` | none (the speakers of a model with speech output; [Speech output](speech.md)) |
| POST | `/tokenize` | [tokenize request](#post-tokenize) (vLLM's) |
| POST | `/detokenize` | [detokenize request](#post-detokenize) (vLLM's) |
| GET | `/tokenizer_info` | none (vLLM's: special tokens, chat template) |
"""

_CLAUDE_HELLO = {
    "model": "SmolLM2-135M-Instruct",
    "system": "Answer in one word.",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
}
EXAMPLES = {
    "/v1/responses": {
        "model": "SmolLM2-135M-Instruct",
        "instructions": "Answer in one word.",
        "input": "What is the capital of France?",
        "max_output_tokens": 16,
        "stream": True,
    },
    "/v1/messages": {**_CLAUDE_HELLO, "max_tokens": 16, "stream": True},
    "/v1/messages/count_tokens": _CLAUDE_HELLO,
    "/v1/chat/completions": {
        "model": "SmolLM2-135M-Instruct",
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "/v1/completions": {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "The capital of France is",
        "max_tokens": 8,
    },
    "/tokenize": {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is"},
    "/detokenize": {"model": "SmolLM2-135M-Instruct", "tokens": [504, 3575, 282, 4649, 314]},
}


def render() -> str:
    from trtedge.server.anthropic.protocol import CountTokensRequest, MessagesRequest
    from trtedge.server.openai.protocol import ChatCompletionRequest, CompletionRequest
    from trtedge.server.openai.tokenization import DetokenizeRequest, TokenizeRequest
    from trtedge.server.responses.protocol import ResponsesRequest

    responses = json.loads(RESPONSES.read_text())
    parts = [HEADER]
    for path in ("/health", "/v1/models", "/tokenizer_info"):
        parts.append(f"## GET `{path}`\n\nExample response:\n\n```json\n{json.dumps(responses[path], indent=2)}\n```\n")
    for path, model in (
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/completions", CompletionRequest),
        ("/v1/responses", ResponsesRequest),
        ("/v1/messages", MessagesRequest),
        ("/v1/messages/count_tokens", CountTokensRequest),
        ("/tokenize", TokenizeRequest),
        ("/detokenize", DetokenizeRequest),
    ):
        model.model_validate(EXAMPLES[path])  # an example that no longer validates fails the generation
        schema = model.model_json_schema()
        defs = schema.get("$defs", {})
        required = set(schema.get("required", []))
        parts.append(f"## POST `{path}`\n")
        parts.append("| field | type | default | constraints |\n| --- | --- | --- | --- |")
        for name, prop in schema["properties"].items():
            default = "required" if name in required else f"`{json.dumps(prop.get('default'))}`"
            parts.append(f"| `{name}` | {_type(prop, defs)} | {default} | {_limits(prop)} |")
        parts.append("\nExample:\n")
        parts.append(f"```bash\ncurl http://127.0.0.1:8000{path} -H 'Content-Type: application/json' -d '")
        parts.append(json.dumps(EXAMPLES[path], indent=2) + "'\n```\n")
        streamed = " (the same request with `\"stream\": false`)" if EXAMPLES[path].get("stream") else ""
        parts.append(f"Response{streamed}:\n\n```json\n{json.dumps(responses[path], indent=2)}\n```\n")
        for ref, sub in sorted(defs.items()):
            if ref not in _DONE:
                _DONE.add(ref)
                parts.append(f"### `{ref}`\n")
                parts.append("| field | type | default |\n| --- | --- | --- |")
                for name, prop in sub["properties"].items():
                    default = (
                        "required"
                        if name in sub.get("required", [])
                        else f"`{json.dumps(prop.get('default'))}`"
                    )
                    parts.append(f"| `{name}` | {_type(prop, defs)} | {default} |")
                parts.append("")
    _DONE.clear()
    parts.append(_transcription())
    return "\n".join(parts).rstrip() + "\n"


TRANSCRIPTION = """
Example:

```bash
curl http://127.0.0.1:8000/v1/audio/transcriptions -F file=@clip.wav -F language=en
```

Response:

```json
{
  "text": "Hello from trtedge.",
  "usage": {"type": "tokens", "input_tokens": 48, "output_tokens": 7, "total_tokens": 55,
            "input_token_details": {"audio_tokens": 39, "text_tokens": 9}}
}
```
"""


def _transcription() -> str:
    """The multipart form of /v1/audio/transcriptions (not a pydantic model: the document's own schema)."""
    from trtedge.server.openapi import _TRANSCRIPTION_FORM as form

    rows = ["## POST `/v1/audio/transcriptions`\n", "A `multipart/form-data` body.\n"]
    rows.append("| field | type | default | constraints |\n| --- | --- | --- | --- |")
    for name, prop in form["properties"].items():
        kind = "file" if name == "file" else _type(prop, {})
        default = "required" if name in form["required"] else f"`{json.dumps(prop.get('default'))}`"
        rows.append(f"| `{name}` | {kind} | {default} | {_limits(prop)} |")
    return "\n".join(rows) + "\n" + TRANSCRIPTION


_DONE: set[str] = set()


def _type(prop: dict, defs: dict) -> str:
    if "anyOf" in prop:
        return " or ".join(dict.fromkeys(_type(p, defs) for p in prop["anyOf"]))
    if "$ref" in prop:
        return f"`{prop['$ref'].rsplit('/', 1)[-1]}`"
    if "enum" in prop:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    kind = prop.get("type")
    if kind == "array":
        return f"array of {_type(prop.get('items', {}), defs)}"
    if kind == "object":
        extra = prop.get("additionalProperties")
        return f"object of {_type(extra, defs)}" if isinstance(extra, dict) and extra else "object"
    return kind or "any"


def _limits(prop: dict) -> str:
    marks = {
        "minimum": ">=",
        "exclusiveMinimum": ">",
        "maximum": "<=",
        "exclusiveMaximum": "<",
        "minItems": "items >=",
    }
    found = []
    for p in [prop, *prop.get("anyOf", [])]:
        for key, sign in marks.items():
            if key in p:
                found.append(f"{sign} {p[key]}")
        items = p.get("items", {})
        for key, sign in marks.items():
            if isinstance(items, dict) and key in items:
                found.append(f"each {sign} {items[key]}")
    return ", ".join(dict.fromkeys(found))


def main(argv: list[str]) -> int:
    from _pages import write_or_check

    return write_or_check(PAGE, render(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
