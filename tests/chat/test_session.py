"""Conversation state, slash commands, formatting and reasoning splitting: no terminal, no model."""

from __future__ import annotations

import json

import pytest

from trtedge.chat.backends import TurnMetrics
from trtedge.chat.session import (
    COMMANDS,
    ChatSession,
    ThinkSplitter,
    context_warning,
    format_metrics,
    format_totals,
    update_params,
)
from trtedge.runtime.sampling_params import SamplingParams


def _session(**kw) -> ChatSession:
    return ChatSession(SamplingParams(max_tokens=32, temperature=0.0), **kw)


def test_conversation_puts_the_system_message_first():
    s = _session(system="Be brief.")
    s.add_user("hi")
    s.add_answer("hello")
    assert s.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]


def test_system_command_shows_sets_and_removes():
    s = _session()
    assert "no system message" in s.execute("/system").message
    s.execute("/system You are a pirate.")
    assert s.system == "You are a pirate."
    assert "pirate" in s.execute("/system").message
    s.execute("/system none")
    assert s.system is None and s.conversation() == []


def test_params_are_validated_by_sampling_params_and_errors_keep_the_old_ones():
    s = _session()
    result = s.execute("/params temperature=0.7 max_tokens=256 seed=1")
    assert not result.error
    assert (s.params.temperature, s.params.max_tokens, s.params.seed) == (0.7, 256, 1)
    assert "temperature=0.7" in result.message
    for bad, words in [
        ("temperature=-1", "temperature must be"),
        ("max_tokens=0", "max_tokens must be"),
        ("max_tokens=2.5", "max_tokens must be an integer"),
        ("top_p=abc", "top_p must be a number"),
        ("bogus=1", "unknown parameter 'bogus'"),
        ("temperature", "expected KEY=VALUE"),
    ]:
        result = s.execute(f"/params {bad}")
        assert result.error and words in result.message, (bad, result.message)
    assert (s.params.temperature, s.params.max_tokens, s.params.seed) == (0.7, 256, 1)


def test_params_accept_none_for_seed_and_a_stop_string():
    p = update_params(SamplingParams(seed=3), "seed=none stop=\\n\\n top-k=5")
    assert p.seed is None and p.stop == ("\n\n",) and p.top_k == 5
    assert update_params(p, "stop=none").stop == ()


def test_params_without_arguments_show_the_current_ones():
    result = _session().execute("/params")
    assert result.message.startswith("params: max_tokens=32 temperature=0.0")


def test_clear_keeps_system_and_params():
    s = _session(system="sys")
    s.add_user("q")
    s.add_answer("a")
    s.context_tokens = 99
    assert "2 messages" in s.execute("/clear").message
    assert s.messages == [] and s.system == "sys" and s.context_tokens == 0


def test_retry_drops_the_last_answer_or_says_there_is_nothing():
    s = _session()
    result = s.execute("/retry")
    assert result.error and "nothing to retry" in result.message
    s.add_user("q")
    s.add_answer("a")
    result = s.execute("/retry")
    assert result.action == "retry" and s.messages == [{"role": "user", "content": "q"}]


def test_unanswered_question_is_dropped():
    s = _session()
    s.add_user("q")
    s.drop_unanswered()
    assert s.messages == []


def test_think_toggles_and_rejects_other_values():
    s = _session()
    assert not s.show_thinking
    assert "shown" in s.execute("/think on").message and s.show_thinking
    assert "collapsed" in s.execute("/think off").message and not s.show_thinking
    assert s.execute("/think maybe").error


def test_unknown_commands_and_unique_prefixes():
    s = _session()
    result = s.execute("/frobnicate")
    assert result.error and "/help" in result.message
    assert "commands:" in s.execute("/he").message  # unique prefix of /help
    assert s.execute("/s").error  # /system, /stats, /save: ambiguous
    assert s.execute("/exit").action == "exit"
    assert s.execute("/quit").action == "exit"
    assert s.execute("/model").action == "model"


def test_help_lists_every_command():
    text = _session().execute("/help").message
    for name in COMMANDS:
        assert f"/{name}" in text


def test_save_and_load_round_trip(tmp_path):
    s = _session(system="sys")
    s.execute("/params temperature=0.5 seed=7")
    s.add_user("q")
    s.add_answer("a")
    path = tmp_path / "chat.json"
    assert "saved 2 messages" in s.execute(f"/save {path}").message
    data = json.loads(path.read_text())
    assert data["format"] == "trtedge-chat/1"
    assert data["messages"][0] == {"role": "system", "content": "sys"}
    assert data["params"]["seed"] == 7

    t = _session()
    assert "loaded 2 messages" in t.execute(f"/load {path}").message
    assert t.conversation() == s.conversation()
    assert t.params == s.params


def test_load_takes_a_plain_message_list_and_refuses_malformed_files(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    s = _session()
    assert not s.execute(f"/load {path}").error and s.messages == [{"role": "user", "content": "hi"}]
    for bad in ['{"messages": 3}', '[{"role": "tool", "content": "x"}]', "not json"]:
        path.write_text(bad)
        result = s.execute(f"/load {path}")
        assert result.error and result.message.startswith("/load:"), bad
    assert s.messages == [{"role": "user", "content": "hi"}]
    assert s.execute(f"/load {tmp_path / 'missing.json'}").error
    assert s.execute("/save").error and s.execute("/load").error


def test_metrics_line_and_context_warning():
    m = TurnMetrics(
        prompt_tokens=100,
        generated_tokens=20,
        time_to_first_token=0.25,
        decode_tokens_per_second=41.5,
        latency=0.71,
        finish_reason="stop",
    )
    line = format_metrics(m, 1024)
    assert line == "TTFT 250 ms · 41.5 tok/s · 20 tokens · latency 710 ms · context 120/1024 (12%)"
    m.finish_reason = "cancelled"
    assert format_metrics(m, None).endswith("context 120 tokens · cancelled")
    assert context_warning(120, 1024) is None
    warning = context_warning(900, 1024)
    assert "124 tokens left" in warning and "/clear" in warning


def test_totals_add_up_turns():
    s = _session(max_context=1000)
    s.record(TurnMetrics(50, 11, 0.2, 10.0, 1.2, "stop"))
    s.record(TurnMetrics(80, 21, 0.4, 20.0, 1.4, "cancelled"))
    t = s.totals
    assert (t.turns, t.cancelled, t.prompt_tokens, t.generated_tokens) == (2, 1, 130, 32)
    assert s.context_tokens == 101
    text = format_totals(t, s.context_tokens, s.max_context)
    assert "2 (1 cancelled)" in text and "mean TTFT" in text and "300 ms" in text
    assert "15.0 tok/s" in text  # (10 + 20) tokens over (1 + 1) s
    assert "101/1000" in text
    assert "answers" in s.execute("/stats").message


@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
def test_think_splitter_survives_any_delta_boundaries(step):
    text = "<think>Let me see: 2 < 3.</think>The answer is <b>yes</b>."
    splitter = ThinkSplitter()
    pieces = []
    for i in range(0, len(text), step):
        pieces += splitter.feed(text[i : i + step])
    pieces += splitter.flush()
    reasoning = "".join(t for r, t in pieces if r)
    answer = "".join(t for r, t in pieces if not r)
    assert reasoning == "Let me see: 2 < 3."
    assert answer == "The answer is <b>yes</b>."


def test_think_splitter_passes_plain_text_and_flushes_a_dangling_prefix():
    splitter = ThinkSplitter()
    assert splitter.feed("Hello <thi") == [(False, "Hello ")]
    assert splitter.flush() == [(False, "<thi")]
