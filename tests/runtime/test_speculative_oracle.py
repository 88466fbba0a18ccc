"""The benchmarks' oracle proposer: replaying a plain greedy run's tokens, every draft is accepted (each
verification step emits k + 1 tokens), the output equals plain decoding and nothing leaks."""

from __future__ import annotations

import pytest

from tests.runtime.spec_helpers import repetitive_prompts
from tests.tiny import VOCAB, make_tiny_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.speculative.oracle import OracleProposer, common_prefix, install, settle

GREEDY = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)


def _llm(path, spec=None) -> LLM:
    return LLM(
        str(path),
        max_kv_cache_capacity=256,
        max_input_len=128,
        max_batch_size=4,
        enable_in_flight_batching=True,
        engine_process=False,
        speculative_config=spec,
    )


def test_oracle_drafts_are_all_accepted_and_the_output_equals_plain(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    prompts = [p[:9] for p in repetitive_prompts(4, seed=5)]
    with _llm(path) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    oracle = OracleProposer()
    for prompt, tokens in zip(prompts, expected):
        oracle.remember(prompt, tokens)
    with _llm(path, {"method": "ngram", "num_speculative_tokens": 4}) as llm:
        install(llm.engine, oracle)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        for out in outs:
            m = out.metrics
            # 13 tokens: the prefill's, two steps of 4 drafts + the bonus, then the last 1 draft + the bonus
            assert (m.spec_steps, m.spec_draft_tokens, m.spec_accepted_tokens) == (3, 9, 9)
            assert m.spec_mean_accepted_length == pytest.approx(12 / 3)
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
        # a prompt it has no answer for, or an output that parts from the answer: no drafts
        other = llm.generate([prompts[0][1:]], GREEDY)[0]
        assert other.metrics.spec_steps == 0


def test_install_needs_a_chain_drafting_engine(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    with _llm(path) as llm, pytest.raises(ValueError, match="speculative config with linear chains"):
        install(llm.engine, OracleProposer())


def test_settle_runs_until_the_output_is_the_answer_the_oracle_drafts_from(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "t", "qwen3")
    prompt = repetitive_prompts(1, seed=5)[0][:9]
    with _llm(path) as plain:
        expected = plain.generate(prompt, GREEDY).token_ids
    oracle = OracleProposer()
    # an answer that parts from the target's output at token 5 (as a bf16 verify step's rounding may)
    oracle.remember(prompt, expected[:5] + [(expected[5] + 1) % VOCAB] + expected[6:])
    with _llm(path, {"method": "ngram", "num_speculative_tokens": 4}) as llm:
        install(llm.engine, oracle)
        assert (
            settle(llm, prompt, GREEDY, oracle) == 2
        )  # the first run learns the output, the second repeats it
        assert oracle.answers[tuple(prompt)] == expected
        m = llm.generate(prompt, GREEDY).metrics
        assert m.spec_accepted_tokens == m.spec_draft_tokens == 9
        assert settle(llm, prompt, GREEDY, oracle, max_runs=1) == 1
        oracle.remember(prompt, [])  # an answer no run repeats within max_runs
        assert settle(llm, prompt, GREEDY, oracle, max_runs=1) == 0


def test_settle_gives_up_when_a_run_agrees_no_further_than_the_one_before():
    """Deterministic runs agree further with their answer every run; runs that do not (here an engine
    alternating between two outputs) cannot settle, and settle stops instead of running them all."""
    from types import SimpleNamespace

    class Alternating:
        runs = 0

        def generate(self, prompt_ids, params):
            self.runs += 1
            return SimpleNamespace(token_ids=[1, 2, 3] if self.runs % 2 else [1, 2, 4])

    llm = Alternating()
    assert settle(llm, [9], GREEDY, OracleProposer()) == 0 and llm.runs == 3
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 5]) == 1
