"""The public Python API on the embedded model and on tiny checkpoints."""

from __future__ import annotations

import json

import pytest

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, CheckpointError, ConfigError, PromptTooLongError, SamplingParams

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def test_embedded_model_answers_paris(smollm):
    out = smollm.chat(PARIS, SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
    assert out.prompt_tokens > 10 and out.completion_tokens == len(out.token_ids) > 0


def test_stream_concatenates_to_text_with_multibyte(smollm):
    messages = [{"role": "user", "content": "Translate to Japanese and French: good morning, café, 日本"}]
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=7)
    full = smollm.chat(messages, params)
    deltas = list(smollm.generate_stream(messages, params))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert any(ord(c) > 127 for c in full.text), full.text
    assert deltas[-1].finish_reason == full.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert all("\ufffd" not in d.text for d in deltas)


def test_seeded_sampling_repeats_and_differs_by_seed(smollm):
    prompt = "Once upon a time"
    a = smollm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    b = smollm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    c = smollm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=2))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_ends_generation_and_is_not_returned(smollm):
    greedy = smollm.chat(PARIS, SamplingParams(max_tokens=32, temperature=0))
    assert " is " in greedy.text
    out = smollm.chat(PARIS, SamplingParams(max_tokens=32, temperature=0, stop=[" is "]))
    assert out.finish_reason == "stop"
    assert out.text == greedy.text[: greedy.text.index(" is ")]


def test_prompt_too_long_gives_both_numbers(smollm):
    with pytest.raises(PromptTooLongError, match=r"\d+ tokens.*max_input_len 1024"):
        smollm.generate(list(range(5, 1100)), SamplingParams(max_tokens=4))
    with pytest.raises(PromptTooLongError, match=r"prompt \(1000 tokens\) \+ max_tokens \(1100\).*2048"):
        smollm.generate(list(range(5, 1005)), SamplingParams(max_tokens=1100))


def test_preformatted_prompt_passes_through(smollm):
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    raw = smollm.generate(text, SamplingParams(max_tokens=16, temperature=0))
    templated = smollm.chat(PARIS, SamplingParams(max_tokens=16, temperature=0), chat_template_kwargs={})
    assert raw.prompt_tokens < templated.prompt_tokens  # no default system prompt added
    assert "Paris" in raw.text


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("seed", -1),
        ("seed", 2**64),
        ("stop", [""]),
        ("logprobs", 21),
        ("logit_bias", {5: 101}),
        ("min_p", 2.0),
        ("temperature", float("nan")),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"max_input_len": 0}, "--max-input-len"),
        ({"max_kv_cache_capacity": -5}, "--max-kv-cache-capacity"),
        ({"max_input_len": 9000}, "--max-input-len"),
        ({"dtype": "float8"}, "--dtype"),
        ({"device": "tpu"}, "--device"),
        ({"weights": "int3"}, "--weights"),
        ({"context_cache_config": {"enabled": True, "bogus": 1}}, "bogus"),
    ],
)
def test_bad_launch_config_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        LLM(**kwargs)


def test_missing_path_is_one_line_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory") as e:
        LLM(str(tmp_path / "nope"))
    assert "\n" not in str(e.value)


def test_onnx_and_engine_dirs_are_refused(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(CheckpointError, match="original checkpoint"):
        LLM(str(tmp_path / "model.onnx"))
    with pytest.raises(CheckpointError, match="original checkpoint"):
        LLM(str(tmp_path))
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    (engine_dir / "rank0.engine").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="original checkpoint"):
        LLM(str(engine_dir))


def test_corrupt_safetensors_names_the_file(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(path))


def test_unsupported_model_type_lists_supported(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt_bigcode"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="gpt_bigcode.*llama, mistral, qwen2, qwen3"):
        LLM(str(path))


def test_offline_uncached_hub_id_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="some-org/some-model.*offline"):
        LLM("some-org/some-model", cache_dir=str(tmp_path))


def test_sharded_checkpoint_loads(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file)
    (path / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with LLM(str(path), max_kv_cache_capacity=128, max_input_len=64) as llm:
        out = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4
    assert torch.is_tensor(tensors[names[0]])


def test_prompt_token_ids_outside_vocabulary_are_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    with LLM(str(path), max_kv_cache_capacity=64) as llm:
        for bad in (512, -1):
            with pytest.raises(ValueError, match=f"token id {bad}.*vocabulary"):
                llm.generate([5, bad], SamplingParams(max_tokens=2))
        assert llm.generate([5, 6], SamplingParams(max_tokens=2, temperature=0)).completion_tokens == 2


def test_engine_that_keeps_failing_reports_the_error_and_refuses_work(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    with LLM(str(path), max_kv_cache_capacity=64) as llm:

        def broken(batch):
            raise RuntimeError("device lost")

        llm.engine.runner.run = broken
        for _ in range(3):
            with pytest.raises(RuntimeError, match="device lost"):
                llm.generate([5, 6], SamplingParams(max_tokens=2))
        assert "device lost" in llm.stats()["engine_error"]
        with pytest.raises(RuntimeError, match="engine failed"):
            llm.generate([5, 6], SamplingParams(max_tokens=2))
