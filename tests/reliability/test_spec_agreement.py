"""/openapi.json and the request models the server validates with agree: every body Hypothesis draws
from the document (some of them broken on purpose) is accepted by the server's parser exactly when the
document accepts it. No server is needed: this is the document against ``parse_request``."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability import fuzz
from trtedge.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from trtedge.server.errors import APIError
from trtedge.server.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from trtedge.server.openapi import openapi_schema
from trtedge.server.responses.protocol import ResponsesRequest

jsonschema = pytest.importorskip("jsonschema")

MODELS = {
    m.__name__: m
    for m in (ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest, CountTokensRequest)
}
NUM_CASES = 400  # the default run; the slow test draws 5000


def bodies(document: dict) -> st.SearchStrategy:
    """(model name, body): drawn from the document, then maybe broken (a field dropped or given a
    hostile value)."""
    schema = fuzz.Schema(document)
    names = sorted(MODELS)

    def broken(name_body, how, index, hostile):
        name, body = name_body
        keys = sorted(body)
        if how == "keep" or not keys:
            return name, body
        key = keys[index % len(keys)]
        body = dict(body)
        if how == "drop":
            del body[key]
        else:
            body[key] = fuzz.HOSTILE[hostile]
        return name, body

    drawn = st.sampled_from(names).flatmap(
        lambda n: schema.strategy({"$ref": f"#/components/schemas/{n}"}).map(lambda b: (n, b))
    )
    how = st.sampled_from(["keep", "keep", "drop", "hostile"])
    return st.builds(broken, drawn, how, st.integers(0, 50), st.integers(0, len(fuzz.HOSTILE) - 1))


def test_the_document_accepts_exactly_what_the_server_parses():
    agreement(NUM_CASES)


@pytest.mark.slow
def test_the_document_accepts_exactly_what_the_server_parses_long():
    agreement(5000)


def agreement(num_cases: int) -> None:
    document = openapi_schema()
    validators = {
        name: jsonschema.Draft202012Validator(
            {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
        )
        for name in MODELS
    }
    tally = {"accepted": 0, "refused": 0}

    @settings(
        max_examples=num_cases,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bodies(document))
    def agree(name_body):
        name, body = name_body
        documented = validators[name].is_valid(body)
        try:
            parse_request(json.dumps(body).encode(), MODELS[name])
            parsed, why = True, None
        except APIError as e:
            parsed, why = False, e.message
        tally["accepted" if parsed else "refused"] += 1
        where = f"{name} {json.dumps(body)[:400]}"
        assert parsed == documented, (
            f"document {'accepts' if documented else 'refuses'}, server {why}: {where}"
        )

    agree()
    print("agreement:", tally)
    assert tally["accepted"] > num_cases // 10 and tally["refused"] > num_cases // 10
