"""The sampler on synthetic logits, and each sampling parameter end to end on a tiny checkpoint."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.sampler import Sampler, mix_seed

VOCAB = 8


def seq_with(tokens=(1, 2, 3), outputs=(), seed=0, **params) -> Sequence:
    seq = Sequence(list(tokens), SamplingParams(**params))
    seq.token_ids.extend(outputs)
    seq.seed = seed
    return seq


def sample(logits, *seqs):
    logits = torch.tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits.expand(len(seqs), -1).clone()
    return Sampler(frozenset({0}))(logits, list(seqs))


def pick(logits, **kwargs) -> int:
    """The token one sequence (built by ``seq_with(**kwargs)``) gets from ``logits``."""
    return sample(logits, seq_with(**kwargs))[0][0]


def draws(logits, n=2000, **params) -> Counter:
    """Sample one row at n different positions (so n independent draws)."""
    counts = Counter()
    for i in range(n):
        [token], _ = sample(logits, seq_with(tokens=[1] * (i + 1), seed=11, **params))
        counts[token] += 1
    return counts


LOGITS = [0.0, 2.0, 1.5, 1.0, -1.0, 0.5, 0.2, -3.0]


def test_greedy_is_argmax_and_top_k_1_equals_greedy():
    assert pick(LOGITS, temperature=0) == 1
    assert pick(LOGITS, temperature=1.5, top_k=1, seed=3) == 1
    counts = draws(LOGITS, n=300, temperature=1.0, top_k=1)
    assert counts == Counter({1: 300})


def test_samples_follow_the_softmax():
    n = 4000
    counts = draws(LOGITS, n=n, temperature=1.0)
    probs = torch.softmax(torch.tensor(LOGITS), -1).tolist()
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs))
    assert chi2 < 30, (counts, probs)  # 7 degrees of freedom: p < 1e-4 for a correct sampler


def test_temperature_sharpens_and_flattens():
    cold = draws(LOGITS, n=400, temperature=0.1)
    hot = draws(LOGITS, n=400, temperature=5.0)
    assert cold[1] > 390
    assert hot[1] < 150 and len(hot) == VOCAB


def test_top_k_keeps_the_k_most_likely():
    counts = draws(LOGITS, n=500, top_k=2)
    assert set(counts) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert set(draws(logits, n=500, top_p=0.7)) == {0, 1}
    assert set(draws(logits, n=500, top_p=0.85)) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08]).log().tolist()
    assert set(draws(logits, n=500, min_p=0.5)) == {0, 1}
    assert set(draws(logits, n=800, min_p=0.3)) == {0, 1, 2, 3}


def test_logit_bias_forces_and_bans_tokens():
    assert pick(LOGITS, temperature=0, logit_bias={7: 100}) == 7
    assert pick(LOGITS, temperature=0, logit_bias={1: -100}) == 2
    counts = draws(LOGITS, n=300, logit_bias={1: -100, 2: -100})
    assert 1 not in counts and 2 not in counts


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # token 1 (2.0) is in the prompt: 2.0 / 1.5 = 1.33 < 1.5 (token 2), so greedy moves to token 2
    assert pick(LOGITS, tokens=[1], temperature=0, repetition_penalty=1.5) == 2
    assert pick(LOGITS, tokens=[3], temperature=0, repetition_penalty=1.5) == 1
    _, [info] = sample([-1.0, -1.2], seq_with(tokens=[0], temperature=0, repetition_penalty=2.0, logprobs=1))
    assert info.token_id == 1  # -1.0 * 2 = -2.0 < -1.2


def test_frequency_and_presence_penalties_count_output_tokens():
    base = seq_with(tokens=[5], outputs=[1, 1, 1], temperature=0)
    assert sample(LOGITS, base)[0] == [1]
    # frequency: 2.0 - 3 x 0.2 = 1.4 < 1.5
    assert pick(LOGITS, tokens=[5], outputs=[1, 1, 1], temperature=0, frequency_penalty=0.2) == 2
    # presence: 2.0 - 0.6 = 1.4 < 1.5, once however often it appeared
    assert pick(LOGITS, tokens=[5], outputs=[1, 1, 1], temperature=0, presence_penalty=0.6) == 2
    assert pick(LOGITS, tokens=[5], outputs=[1, 1, 1], temperature=0, presence_penalty=0.4) == 1
    # prompt tokens are not penalised by frequency/presence
    assert pick(LOGITS, tokens=[1, 1, 1], temperature=0, frequency_penalty=2.0) == 1
    # negative penalties encourage repetition: 1.5 + 2.0 > 2.0
    assert pick(LOGITS, tokens=[5], outputs=[2], temperature=0, presence_penalty=-2.0) == 2


def test_penalties_change_the_repeated_tokens_logprob():
    _, [plain] = sample(LOGITS, seq_with(outputs=[1, 1], temperature=0, logprobs=0))
    _, [pen] = sample(LOGITS, seq_with(outputs=[1, 1], temperature=0, logprobs=0, frequency_penalty=0.1))
    assert plain.token_id == pen.token_id == 1
    assert pen.logprob < plain.logprob - 0.05


def test_logprobs_and_top_logprobs():
    _, [info] = sample(LOGITS, seq_with(temperature=0, logprobs=3))
    expected = torch.log_softmax(torch.tensor(LOGITS), -1)
    assert info.token_id == 1 and math.isclose(info.logprob, float(expected[1]), abs_tol=1e-5)
    assert [t for t, _ in info.top] == [1, 2, 3]
    assert all(math.isclose(lp, float(expected[t]), abs_tol=1e-5) for t, lp in info.top)
    _, [none, zero] = sample(LOGITS, seq_with(temperature=0), seq_with(temperature=0, logprobs=0))
    assert none is None and zero.top == []


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    me = seq_with(seed=2**64 - 1, temperature=0.9, top_p=0.95)
    alone, _ = sample(LOGITS, me)
    others = [seq_with(seed=s, temperature=1.3, top_k=3, repetition_penalty=1.2) for s in range(5)]
    rows = torch.randn(7, VOCAB)
    rows[3] = torch.tensor(LOGITS)
    batch = others[:3] + [me] + others[3:] + [seq_with(temperature=0)]
    tokens, _ = Sampler(frozenset())(rows, batch)
    assert tokens[3] == alone[0]


def test_seeded_stream_is_keyed_on_seed_and_position():
    def run(seed, length):
        return sample(LOGITS, seq_with(tokens=[1] * length, seed=seed))[0][0]

    assert all(run(5, n) == run(5, n) for n in range(1, 30))
    assert [run(5, n) for n in range(1, 30)] != [run(6, n) for n in range(1, 30)]
    assert mix_seed(1, 0) != mix_seed(0, 1) and 0 <= mix_seed(2**64 - 1, 10**6) < 2**64


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="logit_bias has 1025 entries"):
        SamplingParams(logit_bias={i: 1.0 for i in range(1025)})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    assert SamplingParams(logit_bias={"5": 100}).logit_bias == {5: 100.0}
    assert SamplingParams(stop="x").stop == ("x",)


# ---- end to end on a tiny checkpoint (word tokens "w0".."w511", EOS is w2) ---------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "llama")


@pytest.fixture(scope="module")
def tiny(tiny_path):
    options = dict(
        max_kv_cache_capacity=256, max_input_len=128, enable_in_flight_batching=True, max_batch_size=4
    )
    with LLM(str(tiny_path), **options) as llm:
        yield llm


PROMPT = list(range(10, 30))


def greedy(llm, **params):
    return llm.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, **params))


def test_e2e_stop_string_spanning_tokens_is_matched_and_not_returned(tiny):
    full = greedy(tiny)
    words = full.text.split()
    # the end of the 3rd word + the start of the 4th: it spans a token boundary
    stop = words[2][-1] + " " + words[3][:2]
    assert stop in full.text
    out = greedy(tiny, stop=[stop, "never matches"])
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert 1 < len(out.token_ids) <= 4
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, stop=[stop])
    deltas = list(tiny.generate_stream(PROMPT, params))
    assert "".join(d.text for d in deltas) == out.text
    assert deltas[-1].finish_reason == "stop"


def test_e2e_stop_token_ids_ignore_eos_and_max_tokens(tiny):
    full = greedy(tiny)
    out = greedy(tiny, stop_token_ids=[full.token_ids[5]])
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[5]) + 1]
    eos = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, logit_bias={2: 100}))
    assert eos.token_ids == [2] and eos.finish_reason == "stop" and eos.text == ""
    kept = tiny.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=5, logit_bias={2: 100}, ignore_eos=True)
    )
    assert kept.token_ids == [2] * 5 and kept.finish_reason == "length"
    assert len(full.token_ids) == 12 and full.finish_reason == "length"


def test_e2e_logit_bias_top_k_penalties_and_logprobs(tiny):
    full = greedy(tiny)
    with pytest.raises(ValueError, match="logit_bias token id 512 is not below the vocabulary size 512"):
        greedy(tiny, logit_bias={512: 1})
    forced = greedy(tiny, logit_bias={77: 100})
    assert forced.token_ids == [77] * 12
    top1 = SamplingParams(temperature=2.0, top_k=1, seed=3, max_tokens=12, ignore_eos=True)
    assert tiny.generate(PROMPT, top1).token_ids == full.token_ids
    # a strong repetition penalty forbids repeating forced tokens: the bias must beat it each time
    penalised = greedy(tiny, logit_bias={77: 5}, frequency_penalty=2.0)
    assert penalised.token_ids != forced.token_ids
    out = greedy(tiny, logprobs=5)
    assert len(out.logprobs) == 12 and all(len(lp.top) == 5 for lp in out.logprobs)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)  # greedy picks the top one


def test_e2e_seeded_sampling_repeats_and_unseeded_repeats_across_engines(tiny, tiny_path):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = tiny.generate(PROMPT, params)
    b = tiny.generate(PROMPT, params)
    assert a.token_ids == b.token_ids
    other = SamplingParams(temperature=1.0, seed=1235, max_tokens=16, ignore_eos=True)
    assert tiny.generate(PROMPT, other).token_ids != a.token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(str(tiny_path), max_kv_cache_capacity=256, max_input_len=128) as llm:
            runs.append([llm.generate(PROMPT, unseeded).token_ids for _ in range(2)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # each request draws its own seed


def test_e2e_n_choices_share_the_prompt_and_are_independent(tiny):
    prompt = list(range(40, 80))  # 40 tokens: two full blocks shared, the partial one recomputed
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True, n=3, logprobs=1)
    out = tiny.generate(prompt, params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert out.completion_tokens == 24 and out.token_ids == out.outputs[0].token_ids
    assert all(len(o.logprobs) == 8 for o in out.outputs)
    assert tiny.generate(prompt, params).outputs == out.outputs
    # choice 0 is the same as a lone request with the same seed
    alone = tiny.generate(prompt, SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True))
    assert alone.token_ids == out.outputs[0].token_ids
    # a forked choice computes from the shared blocks exactly what a fresh prefill would
    g = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))
    assert g.outputs[0].token_ids == g.outputs[1].token_ids
    assert out.metrics.generated_tokens == 24 and out.metrics.prompt_tokens == 40
    assert tiny.stats()["kv_blocks_free"] == tiny.stats()["kv_blocks_total"]


@pytest.mark.parametrize(
    ("field", "values", "message"),
    [
        ("top_p", [0, 0.0, -0.5, 1.5, 2], r"top_p must be in \(0, 1\], got "),
        ("repetition_penalty", [0, -1.0], r"repetition_penalty must be > 0, got "),
    ],
)
def test_a_range_has_one_rule_and_one_message(field, values, message):
    for value in values:
        with pytest.raises(ValueError, match=message + re.escape(repr(value))):
            SamplingParams(**{field: value})
    SamplingParams(**{field: 1.0})


def test_race_rows_hold_the_seeds_positions_then_the_temperature_bits():
    from trtedge.runtime.executor.sampler import race_rows

    seeds = [3, 2**64 - 7, -5, 2**70 + 3, 2**63]
    positions, temperatures = [10, 0, 7, 2**40, -1], [0.6, 1.5, 0.1, 2.0, 1.0]
    host = race_rows(seeds, positions, temperatures)
    assert host.dtype == torch.long and host.shape == (15,)
    # each seed as the int64 of its bits modulo 2**64: the device mixes what mix_seed mixes
    assert [v & (2**64 - 1) for v in host[:5].tolist()] == [s & (2**64 - 1) for s in seeds]
    assert host[5:10].tolist() == positions
    bits = host[10:].to(torch.int32).view(torch.float32)
    assert bits.tolist() == torch.tensor(temperatures, dtype=torch.float32).tolist()


def test_host_tensor_matches_torch_tensor():
    from trtedge.runtime.executor.sampler import host_tensor

    for values, dtype in [([1, 2, 3], torch.long), ([], torch.long), ([[1, 2], [3, 4]], torch.long),
                          ([0.5, 2], torch.float32), ([7, -8], torch.int32), ([True, False], torch.long)]:  # fmt: skip
        got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)
