"""A schema-driven fuzzer for `trtedge serve`: requests generated with hypothesis from the server's own
/openapi.json (valid ones, and ones broken on purpose), plus hostile raw bodies, checked against the
server's contract: never a 5xx, every 4xx in the documented error shape (400s name the field), no
internals in any body, and streams that end with [DONE]."""

from __future__ import annotations

import collections
import functools
import json
import string
import urllib.parse

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.reliability.common import LEAKS, sse_events

MAX_TOKENS = 3  # valid requests generate a few tokens: the fuzz is about input, not generation
JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=6), v, max_size=3),
    max_leaves=8,
)
HOSTILE = [
    10**12, 10**6, 10**3, -1, 0, 2**64, -(2**63), 10**100, 1e308, -1e308, 0.5, "", "x" * 5000, "\ud800",
    "\u0000", "{{ 7*7 }}", "../../etc/passwd", [], {}, None, True, [[[[[]]]]], {"a": {"b": {"c": []}}},
    [1] * 2000, ["s"] * 1000,
]  # fmt: skip
# Strategies draw indexes into these lists (not the values): failures then print short reprs.
HUGE_FIELDS = {
    "max_tokens": 10**12,
    "max_completion_tokens": 10**12,
    "n": 10**6,
    "top_logprobs": 10**3,
    "logprobs": 10**3,
    "best_of": 10**6,
    "seed": 2**70,
    "priority": 10**30,
    "top_k": 10**15,
    "logit_bias": {str(i): 1 for i in range(10**5)},
    "stop": [f"s{i}" for i in range(10**4)],
    "stop_token_ids": list(range(10**4)),
    "cache_salt": "s" * 10**5,
}


FEATURES = (
    "suffix", "tools", "functions", "tool_choice", "function_call", "response_format", "structured_outputs",
    "guided_decoding", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "text", "reasoning",
)  # fmt: skip


def raw_body(index: int) -> bytes:
    return raw_bodies()[index]


@functools.cache
def raw_bodies() -> list[bytes]:
    deep_list = b"[" * 100_000 + b"]" * 100_000
    deep_object = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    return [
        b"",
        b"\xff\xfe\xfd",
        b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
        b"null",
        b"[]",
        b'"text"',
        b"12",
        b"{",
        b'{"messages": NaN}',
        b'{"prompt": "x", "max_tokens": Infinity}',
        b'{"prompt": "x", "prompt": 5}',
        b"\xef\xbb\xbf{}",
        deep_list,
        deep_object,
        b'{"messages": [{"role": "user", "content": ' + deep_list + b"}]}",
        b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}',
    ]


class Schema:
    """Hypothesis strategies for the JSON schemas of an OpenAPI document."""

    def __init__(self, document: dict):
        self.components = document["components"]["schemas"]

    def strategy(self, schema: dict, depth: int = 0) -> st.SearchStrategy:
        if "$ref" in schema:
            return st.deferred(
                lambda: self.strategy(self.components[schema["$ref"].rsplit("/", 1)[1]], depth + 1)
            )
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.strategy(s, depth) for s in schema[key]])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.strategy({**schema, "type": k}, depth) for k in kind])
        if kind == "string":
            return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
        if kind == "integer":
            lo, hi = schema.get("minimum"), schema.get("maximum")
            ints = st.integers(lo if lo is not None else -1000, hi if hi is not None else 60_000)
            # JSON Schema counts 349.0 as an integer too
            return ints | ints.filter(lambda v: abs(v) < 2**53).map(float)
        if kind == "number":
            lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
            return st.floats(
                lo if lo is not None else -1e6,
                hi if hi is not None else 1e6,
                exclude_min="exclusiveMinimum" in schema,
                allow_nan=False,
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            items = self.strategy(schema.get("items", {}), depth + 1)
            high = min(schema.get("maxItems", 3), 3 if depth < 3 else 1)
            return st.lists(items, min_size=min(schema.get("minItems", 0), high), max_size=high)
        if kind == "object" or "properties" in schema:
            return self._object(schema, depth)
        return JSON_VALUES

    def _object(self, schema: dict, depth: int) -> st.SearchStrategy:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties")
        if not props and isinstance(extra, dict):
            keys = st.text(string.digits, min_size=1, max_size=5) | st.text(max_size=5)
            return st.dictionaries(
                keys, self.strategy(extra, depth + 1), max_size=min(schema.get("maxProperties", 4), 4)
            )
        fixed = {k: self.strategy(v, depth + 1) for k, v in props.items() if k in required}
        optional = {k: self.strategy(v, depth + 1) for k, v in props.items() if k not in required}
        if depth > 4:
            optional = {}
        return st.fixed_dictionaries(fixed, optional=optional)


def _tame(body: dict, model: str, served: bool, plain: bool) -> dict:
    """Keep a generated request cheap to serve when it is valid: a few tokens, a few choices.

    ``served``: it names the served model; ``plain``: it drops the features that need more than random
    values. Hypothesis draws both (``tamed``), so a seed replays the same requests."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for key in limits:
        if key in body and isinstance(body[key], int | float) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if all(body.get(key) is None for key in limits):  # null is unbounded too
        body["max_output_tokens" if "input" in body else "max_tokens"] = MAX_TOKENS  # Responses: its name
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("best_of"), int) and body["best_of"] > 2:
        body["best_of"] = body.get("n", 1)
    if served:
        body["model"] = model
    if plain:
        for key in FEATURES:
            body.pop(key, None)
    return body


def tamed(bodies: st.SearchStrategy, model: str) -> st.SearchStrategy:
    """``bodies`` made cheap by ``_tame``: the served model 9 times in 10 (another name is a 404), most
    requests (7 in 10) plain."""
    return st.tuples(bodies, st.integers(0, 9), st.integers(0, 9)).map(
        lambda t: _tame(t[0], model, served=t[1] < 9, plain=t[2] < 7)
    )


def cases(document: dict, model: str) -> st.SearchStrategy:
    """(method, path, body bytes or None, kind) tuples over every endpoint of the document."""
    schema = Schema(document)
    posts, gets = [], []
    for path, item in document["paths"].items():
        if "post" in item and "application/json" in item["post"]["requestBody"]["content"]:  # not uploads
            ref = item["post"]["requestBody"]["content"]["application/json"]["schema"]
            posts.append((path, schema.strategy(ref)))
        if "get" in item:
            gets.append(path)

    def encode(value) -> bytes:
        return json.dumps(value).encode()

    valid = st.sampled_from(posts).flatmap(
        lambda p: tamed(p[1], model).map(lambda body: ("POST", p[0], encode(body), "valid"))
    )

    def mutate(path_body, how, field, hostile_index):
        path, body = path_body
        hostile = HOSTILE[hostile_index]
        body = dict(body)
        keys = sorted(body) or ["messages"]
        if how == "huge":
            name = sorted(HUGE_FIELDS)[len(field) % len(HUGE_FIELDS)]
            return ("POST", path, ("huge", name, encode(body)), "invalid:huge")
        if how == "hostile":
            body[field if field in body else keys[len(field) % len(keys)]] = hostile
        elif how == "drop":
            body.pop(keys[len(field) % len(keys)], None)
        else:  # a wrong type for a known field
            body[keys[len(field) % len(keys)]] = (
                hostile if not isinstance(hostile, type(body.get(keys[0]))) else "x"
            )
        return ("POST", path, encode(body), f"invalid:{how}")

    bodies_and_paths = st.sampled_from(posts).flatmap(
        lambda p: tamed(p[1], model).map(lambda body: (p[0], body))
    )
    invalid = st.builds(
        mutate,
        bodies_and_paths,
        st.sampled_from(["hostile", "huge", "drop", "type"]),
        st.text(string.ascii_lowercase, max_size=20),
        st.integers(0, len(HOSTILE) - 1),
    )
    raw = st.tuples(st.sampled_from([p for p, _ in posts]), st.integers(0, len(raw_bodies()) - 1)).map(
        lambda pb: ("POST", pb[0], pb[1], "raw")
    )
    model_ids = st.text(max_size=30) | st.sampled_from(
        ["../../etc/passwd", "%00", "a" * 500, "SmolLM2-135M-Instruct"]
    )
    get = st.sampled_from(gets).flatmap(
        lambda path: model_ids.map(lambda m: ("GET", path.replace("{model_id}", _url_safe(m)), None, "get"))
    )
    wrong_method = st.tuples(
        st.sampled_from(["PUT", "DELETE", "PATCH", "GET", "POST"]),
        st.sampled_from([p for p, _ in posts] + gets + ["/v1/nope", "/", "/v1/embeddings", "/v1/../health"]),
    ).map(lambda mp: (mp[0], mp[1].replace("{model_id}", "x"), b"{}", "method"))
    return st.one_of(valid, valid, invalid, invalid, raw, get, wrong_method)


def _url_safe(text: str) -> str:
    return urllib.parse.quote(text, safe="/") or "x"


class Tally:
    def __init__(self):
        self.by_kind = collections.Counter()
        self.by_status = collections.Counter()
        self.by_endpoint = collections.Counter()
        # why the server refused requests the document accepts: (endpoint, field, code), or for the
        # Anthropic routes (no param or code in their errors) the message's start
        self.refused = collections.Counter()
        self.total = 0

    def add(self, method: str, path: str, kind: str, status: int, response: httpx.Response) -> None:
        if status == 400 and kind == "valid":
            error = response.json()["error"]
            if path.startswith("/v1/messages"):
                self.refused[f"{path}: {error['message'][:60]}"] += 1
            else:
                self.refused[f"{path}: {error['param']} ({error['code']})"] += 1
        self.total += 1
        self.by_kind[kind] += 1
        self.by_status[status] += 1
        self.by_endpoint[f"{method} {path if not path.startswith('/v1/models/') else '/v1/models/{id}'}"] += 1

    def report(self) -> dict:
        return {
            "requests": self.total,
            "by_kind": dict(self.by_kind),
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_endpoint": dict(self.by_endpoint),
            "schema_valid_refused_for": dict(self.refused.most_common(40)),
        }


GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


def check(method: str, path: str, kind: str, response: httpx.Response, sent: bytes = b"") -> None:
    """The server's contract for one response (OpenAI's error shape; Anthropic's on /v1/messages*)."""
    status = response.status_code
    where = f"{method} {path} ({kind}) -> {status}: {response.text[:300]!r}"
    assert status < 500, where
    if status >= 400 or path not in GENERATION:  # generated text may hold anything
        echoed = sent.decode("utf-8", "replace") + path
        leaks = [m.group(0) for m in LEAKS.finditer(response.text) if m.group(0) not in echoed]
        assert not leaks, f"{leaks}: {where}"
    anthropic = path.startswith("/v1/messages") and status != 405
    if status >= 400 and anthropic:
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, where
        assert body["error"]["message"], where
    elif status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], where
        # the parser's refusals read "FIELD: why", code invalid_value: never for a body the document accepts
        parsed = error["code"] == "invalid_value" and error["message"].startswith(f"{error['param']}: ")
        assert not (kind == "valid" and parsed), f"the document accepts what the parser refuses: {where}"
        if status == 400 and error["code"] != "invalid_json":
            assert error["param"], f"400 without the field: {where}"
    elif method == "POST" and path in GENERATION:
        streamed = response.headers["content-type"].startswith("text/event-stream")
        if streamed and anthropic:
            events = sse_events(response.text)
            assert events[-1][0] == "message_stop" and all(n != "error" for n, _ in events), where
        elif streamed:
            events = sse_events(response.text)
            assert events[-1][1] == "[DONE]" and all(name != "error" for name, _ in events), where
        elif anthropic:
            assert response.json()["stop_reason"], where
        else:
            body = response.json()
            assert body["choices"] and all(c["finish_reason"] for c in body["choices"]), where


def _validators(document: dict) -> dict:
    """POST path -> a JSON Schema validator of its request body, from the document."""
    import jsonschema

    found = {}
    for path, item in document["paths"].items():
        if "post" in item and "application/json" in item["post"]["requestBody"]["content"]:
            ref = item["post"]["requestBody"]["content"]["application/json"]["schema"]
            found[path] = jsonschema.Draft202012Validator({**ref, "components": document["components"]})
    return found


def run(url: str, num_requests: int, derandomize: bool) -> dict:
    """Send ``num_requests`` generated requests to the server at ``url``; return the tally."""
    document = httpx.get(f"{url}/openapi.json", timeout=30).json()
    tally = Tally()
    validators = _validators(document)
    client = httpx.Client(base_url=url, timeout=120)
    model = client.get("/v1/models").json()["data"][0]["id"]

    @settings(
        max_examples=num_requests,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],  # report the failing request as sent; shrinking would resend hundreds
    )
    @given(cases(document, model))
    def fuzz(case):
        method, path, body, kind = case
        if kind == "raw":
            body = raw_body(body)
        elif kind == "invalid:huge":
            _, name, base = body
            body = json.dumps({**json.loads(base), name: HUGE_FIELDS[name]}).encode()
        elif kind == "valid" and not validators[path].is_valid(json.loads(body)):
            kind = "valid:off-schema"  # e.g. a tool message without tool_call_id (an if/then we do not draw)
        headers = {"content-type": "application/json"}
        response = client.request(method, path, content=body, headers=headers)
        tally.add(method, path, kind, response.status_code, response)
        check(method, path, kind, response, body or b"")

    try:
        fuzz()
    finally:
        client.close()
    return tally.report()
