"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and what lm-evaluation-harness's
remote tokenizer reads from them, on the embedded model in-process."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import load_llm
from tests.server.test_api import assert_error, request
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = load_llm(tmp_path_factory)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm)


def test_tokenize_then_detokenize_gives_the_text_back(app, llm):
    text = "Héllo wörld, 1 + 1 = 2 🙂"
    r = request(app, "POST", "/tokenize", json={"prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200, body
    assert body["tokens"] == llm.tokenizer.encode(text) and body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] == llm.config.max_kv_cache_capacity
    assert body["token_strs"] == [llm.tokenizer.id_to_token(t) for t in body["tokens"]]
    back = request(app, "POST", "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_counts_what_chat_completions_prefills(app):
    r = request(app, "POST", "/tokenize", json={"messages": PARIS})
    chat = request(app, "POST", "/v1/chat/completions", json={"messages": PARIS, "max_tokens": 1})
    assert r.status_code == 200 and chat.status_code == 200
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    assert r.json()["token_strs"] is None
    plain = request(app, "POST", "/tokenize", json={"messages": PARIS, "add_generation_prompt": False})
    assert plain.json()["count"] < r.json()["count"]  # the assistant header is left out


def test_tokenizer_info_is_what_lm_eval_s_remote_tokenizer_needs(app, llm):
    r = request(app, "GET", "/tokenizer_info")
    info = r.json()
    assert r.status_code == 200 and info["tokenizer_class"]
    assert info["chat_template"] == llm.tokenizer.chat_template
    assert info["eos_token"] == llm.tokenizer.eos_token
    # lm-eval takes the EOS id as the first id of the EOS text, tokenized without special tokens
    eos = request(app, "POST", "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] in llm.tokenizer.eos_token_ids


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": PARIS}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenizer_endpoint_errors_name_the_field(app, path, body, param):
    r = request(app, "POST", path, json=body)
    assert_error(r, 404 if param == "model" else 400, param=param)


def test_an_api_key_guards_the_tokenizer_endpoints(llm):
    app = build_app(llm, ServeConfig(api_key="k"))
    for method, path, body in (
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
    ):
        assert request(app, method, path, json=body).status_code == 401
        ok = request(app, method, path, json=body, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200, ok.text


def test_a_one_token_completion_that_samples_eos_reports_its_logprob(app, llm):
    eos = min(llm.tokenizer.eos_token_ids)
    body = {"prompt": "Hi", "max_tokens": 1, "logprobs": 1, "logit_bias": {str(eos): 100}, "temperature": 0}
    r = request(app, "POST", "/v1/completions", json=body)
    out = r.json()
    assert r.status_code == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == ""
    assert out["usage"]["completion_tokens"] == 1
    lp = choice["logprobs"]
    assert lp["tokens"] == [llm.tokenizer.id_to_token(eos)]
    assert len(lp["token_logprobs"]) == 1 and -1.0 < lp["token_logprobs"][0] <= 0.0
    streamed = request(app, "POST", "/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert sum((p["token_logprobs"] for p in logprobs if p), []) == lp["token_logprobs"]
