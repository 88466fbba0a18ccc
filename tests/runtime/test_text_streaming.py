"""The one marker hold-back and <think> splitter the server's parsers and the terminal chat share."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trtedge.runtime.text.streaming import ReasoningSplitter, held_back


def _split(text: str, cuts: list[int], **kwargs) -> tuple[str, str]:
    splitter = ReasoningSplitter(**kwargs)
    pieces = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        pieces += splitter.feed(text[a:b])
    pieces += splitter.flush()
    return "".join(p for r, p in pieces if r), "".join(p for r, p in pieces if not r)


def test_held_back_is_the_longest_tail_that_could_begin_a_marker():
    assert held_back("Hello <thi", "<think>") == 4
    assert held_back("ab</", "</think>", "</tool_call>") == 2
    assert held_back("a <b", "<think>") == 0 and held_back("", "<think>") == 0
    assert held_back("x<think>", "<think>") == 0  # a whole marker is not held: the caller found it


def test_only_the_leading_block_is_reasoning_unless_every_block_is():
    text = "  <think>a</think>\n\nb <think>c</think> d"
    assert _split(text, []) == ("a", "b <think>c</think> d")
    assert _split(text, [], every_block=True) == ("ac", "b d")
    assert _split("plain <think>x", []) == ("", "plain <think>x")
    assert _split("cut short", [], in_reasoning=True) == ("cut short", "")


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="<>/thinkab \n", max_size=40),
    data=st.data(),
    every_block=st.booleans(),
    in_reasoning=st.booleans(),
)
def test_any_cut_gives_what_the_whole_text_gives(text, data, every_block, in_reasoning):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    kwargs = {"every_block": every_block, "in_reasoning": in_reasoning}
    assert _split(text, cuts, **kwargs) == _split(text, [], **kwargs)
