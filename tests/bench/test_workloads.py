"""Workloads: seeded, length-bounded, and readable from JSONL files."""

from __future__ import annotations

import json

import pytest

from trtedge.bench.workloads import FIRST_RANDOM_ID, file_requests, fixed_requests, random_requests


def test_random_workload_is_reproducible_with_a_seed():
    a = random_requests(8, 64, 16, 0.5, 1000, seed=7)
    b = random_requests(8, 64, 16, 0.5, 1000, seed=7)
    c = random_requests(8, 64, 16, 0.5, 1000, seed=8)
    assert a == b
    assert a != c


def test_random_lengths_stay_in_range_and_ids_avoid_special_tokens():
    requests = random_requests(50, 100, 20, 0.25, 1000, seed=0)
    assert all(75 <= r.prompt_len <= 125 and len(r.prompt) == r.prompt_len for r in requests)
    assert all(15 <= r.max_tokens <= 25 for r in requests)
    assert len({r.prompt_len for r in requests}) > 1
    assert all(FIRST_RANDOM_ID <= t < 1000 for r in requests for t in r.prompt)


def test_range_ratio_zero_gives_exact_lengths():
    requests = random_requests(5, 32, 8, 0.0, 1000, seed=1)
    assert {(r.prompt_len, r.max_tokens) for r in requests} == {(32, 8)}


def test_fixed_workload_repeats_one_prompt():
    requests = fixed_requests(4, 16, 4, 1000, seed=0)
    assert len(requests) == 4 and len({tuple(r.prompt) for r in requests}) == 1


def test_bad_range_ratio_names_the_flag():
    with pytest.raises(ValueError, match="--range-ratio"):
        random_requests(1, 8, 8, 1.5, 1000, seed=0)


def test_jsonl_prompts_and_sharegpt_conversations(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "Say hi", "max_tokens": 5},
        {"conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    requests = file_requests(path, 5, output_len=7, seed=0)
    assert len(requests) == 5
    assert {(r.prompt, r.max_tokens) for r in requests} == {("Say hi", 5), ("Why?", 10)}
    assert file_requests(path, 5, 7, seed=0) == requests
