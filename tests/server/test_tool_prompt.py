"""A tool conversation renders through the model's own chat template: the full prompt trtedge builds
equals transformers' rendering of the same conversation with the same template."""

from __future__ import annotations

import json

import pytest

from tests.server.scripted import make_scripted_checkpoint
from trtedge.server.app import build_app
from trtedge.server.config import ServeConfig
from trtedge.server.core import plan_chat
from trtedge.server.openai.protocol import ChatCompletionRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def serving(model_dir, tmp_path_factory):
    from trtedge import LLM

    llm = LLM(
        str(model_dir),
        cache_dir=str(tmp_path_factory.getbasetemp() / "trtedge-cache"),
        max_kv_cache_capacity=512,
        max_input_len=256,
    )
    yield build_app(llm, ServeConfig(enable_auto_tool_choice=True)).state.serving
    llm.close()


def reference(model_dir, messages, tools) -> str:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    converted = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:  # transformers' convention: arguments as a mapping
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        converted.append(m)
    return tokenizer.apply_chat_template(converted, tools=tools, tokenize=False, add_generation_prompt=True)


def test_tool_conversation_prompt_matches_the_template(serving, model_dir):
    plan = plan_chat(
        serving, ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS})
    )
    expected = reference(model_dir, CONVERSATION, TOOLS)
    assert plan.prompt_text == expected
    assert '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>' in expected
    assert '"description": "The weather in a city"' in expected and expected.endswith("<answer> ")
    assert plan.choices[0].prompt_ids == serving.llm.tokenizer.encode(expected, add_special_tokens=False)
    assert plan.tool_format.name == "hermes"  # auto: the template shows <tool_call>
