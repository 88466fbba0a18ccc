"""Prompt logprobs over HTTP on the embedded model: completions ``echo`` + ``logprobs`` (what
lm-evaluation-harness's loglikelihood requests send), ``max_tokens: 0`` (score only) and vLLM's
``prompt_logprobs`` on completions and chat."""

from __future__ import annotations

import json
import math

import pytest

from tests.server.conftest import load_llm
from tests.server.test_api import assert_error, request
from trtedge import SamplingParams
from trtedge.server.app import build_app

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = load_llm(tmp_path_factory)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm)


def completion(app, **body) -> dict:
    r = request(app, "POST", COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(app, llm):
    ids = llm.tokenizer.encode("Question: What is the capital of France?\nAnswer: Paris")
    body = completion(app, prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert choice["text"].startswith(llm.tokenizer.decode(ids, False))
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    # lm-eval's is_greedy: the top-1 alternative is the token itself where the model agreed
    expected = llm.generate(
        ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    ).prompt_logprobs
    for info, value, top in zip(
        expected[1:], lp["token_logprobs"][1 : len(ids)], lp["top_logprobs"][1 : len(ids)]
    ):
        assert math.isclose(value, info.logprob, abs_tol=1e-5)
        assert (max(top.values()) == value) == (info.rank == 1)
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(ids),
        1,
        len(ids) + 1,
    )


def test_the_prefill_scores_a_token_as_decoding_sampled_it(app, llm):
    prompt = llm.tokenizer.encode("The capital of France is")
    greedy = completion(app, prompt=prompt, max_tokens=2, logprobs=0, temperature=0)
    [first, _] = greedy["choices"][0]["logprobs"]["token_logprobs"]
    token = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0)).token_ids[0]
    scored = completion(app, prompt=prompt + [token], max_tokens=0, logprobs=0, echo=True)
    assert math.isclose(scored["choices"][0]["logprobs"]["token_logprobs"][-1], first, abs_tol=1e-4)


def test_max_tokens_zero_scores_the_prompt_only(app, llm):
    text = "Once upon a time"
    ids = llm.tokenizer.encode(text)
    body = completion(app, prompt=text, max_tokens=0, logprobs=2, echo=True)
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    plain = completion(app, prompt=text, max_tokens=0)
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 0
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(app, llm):
    text = "Once upon a time"
    whole = completion(app, prompt=text, max_tokens=3, logprobs=1, echo=True, temperature=0)
    r = request(
        app,
        "POST",
        COMPLETIONS,
        json={"prompt": text, "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0, "stream": True},
    )
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == text and first["logprobs"]["token_logprobs"][0] is None
    streamed = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks if c["choices"]), [])
    assert streamed == whole["choices"][0]["logprobs"]["token_logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]


def test_vllm_prompt_logprobs_on_completions_and_chat(app, llm):
    ids = llm.tokenizer.encode("The capital of France is Paris")
    body = completion(app, prompt=ids, max_tokens=1, prompt_logprobs=2, temperature=0)
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        own = entry[str(token)]
        assert own["decoded_token"] and own["logprob"] <= 0 and own["rank"] >= 1
        assert {1, 2} <= {e["rank"] for e in entry.values()} and len(entry) <= 3  # its own and the top 2
    assert body["choices"][0]["logprobs"] is None  # the output's own logprobs were not asked for
    messages = [{"role": "user", "content": "Hi"}]
    chat = request(
        app,
        "POST",
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    count = chat.json()["usage"]["prompt_tokens"]
    entries = chat.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == count and entries[0] is None and all(len(e) == 1 for e in entries[1:])


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions"])
def test_prompt_logprobs_refuse_streaming_and_bad_values(app, path):
    body = {"prompt": "x"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "x"}]}
    assert_error(
        request(app, "POST", path, json={**body, "prompt_logprobs": 1, "stream": True}),
        400,
        "prompt_logprobs",
    )
    assert_error(request(app, "POST", path, json={**body, "prompt_logprobs": 21}), 400, "prompt_logprobs")
    if path != COMPLETIONS:  # max_tokens 0 is a completions extension (score only)
        assert_error(request(app, "POST", path, json={**body, "max_tokens": 0}), 400, "max_tokens")
