"""Speculative decoding with structured output on the embedded SmolLM2: every draft node is masked
by the guide's state after the tokens before it, so guided greedy output is unchanged."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.guided_schemas import PROMPT, SCHEMAS
from trtedge import LLM, SamplingParams
from trtedge.runtime.artifacts.embedded import embedded_model_path

OPTIONS = dict(
    max_kv_cache_capacity=1024, max_input_len=512, enable_in_flight_batching=True, max_batch_size=8
)


@pytest.fixture(scope="module")
def expected():
    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with LLM(**OPTIONS) as llm:
        return _run(llm)


def _run(llm) -> dict[str, list[int]]:
    names = list(SCHEMAS) + ["free"]
    params = [
        SamplingParams(
            max_tokens=64, temperature=0, guided_decoding={"json": SCHEMAS[n]} if n in SCHEMAS else None
        )
        for n in names
    ]
    streams = [llm.generate_stream(PROMPT, p) for p in params]  # all in one batch
    outs = {}
    for name, stream in zip(names, streams):
        deltas = list(stream)
        outs[name] = [t for d in deltas for t in d.token_ids]
        if name in SCHEMAS:
            jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMAS[name])
    return outs


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4},
        # the target as its own draft; it drafts unguided, so the guide rejects some of its tokens
        {"method": "draft_model", "model": "embedded", "num_speculative_tokens": 3},
    ],
)
def test_guided_greedy_output_is_unchanged_by_speculation(expected, spec):
    if spec.get("model") == "embedded":
        spec = {**spec, "model": str(embedded_model_path())}
    with LLM(**OPTIONS, speculative_config=spec) as llm:
        assert _run(llm) == expected
        totals = llm.speculative_metrics()
        assert totals["steps"] > 0 and totals["accepted_tokens"] > 0
