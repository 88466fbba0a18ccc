"""The client interface every front door uses: plain data for what is loaded and what the engine does,
the chat template and tokenizer through `LLM`'s methods, token bytes for logprobs."""

from __future__ import annotations

import json

from trtedge.llm_views import EngineStats, ModelInfo, TokenizerInfo


def test_describe_is_typed_and_still_reads_as_a_dict(smollm):
    info = smollm.describe()
    assert isinstance(info, ModelInfo)
    assert info["vocab_size"] == info.vocab_size == smollm.vocab_size > 0
    assert dict(info)["device"] == info.device and info.engine_process is False
    assert info.source.startswith("bundle ") and info.bundle_key in info.source
    json.dumps(info.to_dict())  # plain data


def test_stats_are_typed_and_leave_out_what_this_model_has_not(smollm):
    stats = smollm.stats()
    assert isinstance(stats, EngineStats)
    assert stats["kv_blocks_total"] == stats.kv_blocks_total > 0 and stats.engine_error is None
    assert "state_slots_total" not in stats and stats.get("ple_cache") is None  # a plain transformer
    assert {**stats, "engine_error": "x"}["engine_error"] == "x"  # spreads like the dict it replaced


def test_views_keep_figures_a_newer_engine_adds():
    info = ModelInfo.from_dict(
        dict(device="cpu", dtype="float32", weight_bytes=1, kv_bytes_per_token=2, vocab_size=3),
        model_type="llama",
        async_scheduling=False,
        engine_process=False,
        new_figure=7,
    )
    assert info["new_figure"] == 7 and info.extra == {"new_figure": 7}


def test_render_chat_gives_the_ids_encode_prompt_gives(smollm):
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = smollm.render_chat(messages)
    assert rendered.ids == smollm.encode_prompt(messages) == rendered.prompt
    assert "Hi there" in rendered.text == smollm.apply_chat_template(messages)
    assert smollm.tokenize(rendered.text, add_special_tokens=False) == rendered.ids


def test_tokenizer_info_names_the_special_tokens_and_templates(smollm):
    info = smollm.tokenizer_info()
    assert isinstance(info, TokenizerInfo) and info.eos_token_ids
    assert info.template_for(tools=False) == info.chat_template
    assert smollm.detokenize(sorted(info.eos_token_ids)[:1], skip_special_tokens=False)


def test_token_bytes_undo_the_byte_level_spelling(smollm):
    # "é" is two bytes; a byte-level vocabulary may spell it as one piece or as two byte tokens
    ids = smollm.tokenize("café", add_special_tokens=False)
    raw = b"".join(smollm.token_bytes(i) for i in ids)
    assert raw == "café".encode()
    space = smollm.tokenize(" the", add_special_tokens=False)
    assert smollm.token_piece(space[0]).startswith("Ġ") and smollm.token_bytes(space[0]).startswith(b" ")
