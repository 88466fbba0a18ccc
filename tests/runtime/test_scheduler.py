"""The scheduler and the block manager on synthetic requests: no model, no tensors."""

from __future__ import annotations

import itertools

import pytest

from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.request import Sequence, Status
from trtedge.runtime.core.scheduler import Scheduler, SchedulerConfig
from trtedge.runtime.sampling_params import SamplingParams

BLOCK = 4
_tokens = itertools.count(1000)


def create_scheduler(
    num_blocks: int = 64,
    max_batch_size: int = 4,
    max_num_batched_tokens: int = 64,
    ifb: bool = True,
    reuse: bool = False,
    max_records: int = 1024,
) -> Scheduler:
    blocks = BlockManager(num_blocks, BLOCK, enable_reuse=reuse, max_records=max_records)
    config = SchedulerConfig(max_batch_size, max_num_batched_tokens, enable_in_flight_batching=ifb)
    return Scheduler(config, blocks)


def create_requests(
    num: int,
    prompt_len: int = 10,
    max_tokens: int = 4,
    priority: int = 0,
    prompt: list[int] | None = None,
    **params,
) -> list[Sequence]:
    out = []
    for _ in range(num):
        ids = list(prompt) if prompt is not None else [next(_tokens) for _ in range(prompt_len)]
        out.append(Sequence(ids, SamplingParams(max_tokens=max_tokens, **params), priority))
    return out


def step(sched: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran, append a token to every sequence that caught up, finish
    those at max_tokens. Returns request id -> tokens computed this step."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= seq.num_tokens
        assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            if seq.num_output_tokens == 0:
                sched.blocks.publish(seq)
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.blocks.publish(seq)
                sched.finish(seq, "length")
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}


def run_all(sched: Scheduler, limit: int = 1000) -> list[dict[str, int]]:
    steps = []
    while sched.has_work:
        steps.append(step(sched))
        assert len(steps) < limit, "no progress"
    return steps


def test_prompt_is_prefilled_in_chunks_up_to_the_token_budget_then_decoded():
    sched = create_scheduler(max_num_batched_tokens=16)
    [seq] = create_requests(1, prompt_len=40, max_tokens=3)
    sched.add(seq)
    steps = run_all(sched)
    assert [s[seq.request_id] for s in steps] == [16, 16, 8, 1, 1]
    assert seq.output_ids == [7, 7, 7] and seq.is_finished
    assert sched.blocks.num_free_blocks == 64


def test_new_requests_join_the_running_batch_at_the_next_step():
    sched = create_scheduler(max_batch_size=4)
    a, b, c = create_requests(3, prompt_len=8, max_tokens=10)
    sched.add(a)
    assert step(sched) == {a.request_id: 8}
    sched.add(b)
    sched.add(c)
    batch = sched.schedule()
    assert dict(zip((s.request_id for s in batch.seqs), batch.num_tokens)) == {
        a.request_id: 1,
        b.request_id: 8,
        c.request_id: 8,
    }
    assert batch.joined == 2


def test_running_batch_is_capped_at_max_batch_size():
    sched = create_scheduler(max_batch_size=2)
    seqs = create_requests(5, prompt_len=4, max_tokens=3)
    for seq in seqs:
        sched.add(seq)
    steps = run_all(sched)
    assert max(len(s) for s in steps) == 2
    assert all(s.is_finished for s in seqs)


def test_without_in_flight_batching_requests_run_one_at_a_time_in_arrival_order():
    sched = create_scheduler(ifb=False, max_batch_size=8)
    seqs = create_requests(3, prompt_len=4, max_tokens=2)
    for seq in seqs:
        sched.add(seq)
    steps = run_all(sched)
    order = [rid for s in steps for rid in s]
    assert all(len(s) == 1 for s in steps) and order == [
        seqs[0].request_id,
        seqs[0].request_id,
        seqs[1].request_id,
        seqs[1].request_id,
        seqs[2].request_id,
        seqs[2].request_id,
    ]


def test_higher_priority_first_and_fcfs_within_a_priority():
    sched = create_scheduler(ifb=False)
    low = create_requests(1, priority=0, max_tokens=1)
    mid = create_requests(2, priority=5, max_tokens=1)
    high = create_requests(1, priority=9, max_tokens=1)
    for seq in low + mid + high:
        sched.add(seq)
    order = [rid for s in run_all(sched) for rid in s]
    assert order == [s.request_id for s in high + mid + low]


def test_token_budget_is_shared_and_never_exceeded():
    sched = create_scheduler(max_batch_size=8, max_num_batched_tokens=20)
    seqs = create_requests(4, prompt_len=15, max_tokens=3)
    for seq in seqs:
        sched.add(seq)
    steps = run_all(sched)
    assert all(sum(s.values()) <= 20 for s in steps)
    assert all(s.output_ids == [7, 7, 7] for s in seqs)


def test_preemption_evicts_the_lowest_priority_newest_and_recomputes_it():
    # 6 blocks of 4 tokens: three 7-token prompts fit (2 blocks each) but cannot all grow to 12 tokens.
    sched = create_scheduler(num_blocks=6, max_batch_size=3)
    old, new = create_requests(2, prompt_len=7, max_tokens=5, priority=1)
    [low] = create_requests(1, prompt_len=7, max_tokens=5, priority=0)
    for seq in (old, new, low):
        sched.add(seq)
    preempted = []
    while sched.has_work:
        batch = sched.schedule()
        preempted += batch.preempted
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= 5:
                    sched.finish(seq, "length")
    assert preempted[0] is low
    assert old.num_preemptions == 0
    assert all(s.output_ids == [7] * 5 for s in (old, new, low))
    assert sched.blocks.num_free_blocks == 6


def test_preempted_sequence_recomputes_prompt_and_output_tokens():
    sched = create_scheduler(num_blocks=4, max_batch_size=2)
    a, b = create_requests(2, prompt_len=5, max_tokens=6)
    sched.add(a)
    sched.add(b)
    for _ in range(4):  # prefill 5 tokens (2 blocks each: the pool is full), then decode up to 8
        step(sched)
    batch = sched.schedule()  # a needs a third block: b goes
    assert batch.preempted == [b] and b.status is Status.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 4
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        seq.token_ids.append(7)
    run_all(sched)
    assert a.is_finished and b.is_finished and b.num_preemptions >= 1


def test_min_pool_that_fits_one_request_still_finishes_everything():
    sched = create_scheduler(num_blocks=3, max_batch_size=4)  # one 12-token request at a time
    seqs = create_requests(6, prompt_len=5, max_tokens=7)
    for seq in seqs:
        sched.add(seq)
    run_all(sched)
    assert all(s.output_ids == [7] * 7 for s in seqs)
    assert sched.blocks.num_free_blocks == 3


def test_finish_releases_blocks_of_waiting_and_running_sequences():
    sched = create_scheduler(num_blocks=8, max_batch_size=1)
    a, b = create_requests(2, prompt_len=9, max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.blocks.num_free_blocks == 5
    sched.finish(a, "cancelled")
    sched.finish(b, "cancelled")
    assert sched.blocks.num_free_blocks == 8 and not sched.has_work
    assert a.finish_reason == "cancelled"


# ---- context reuse ---------------------------------------------------------------------------


def test_prefix_hit_skips_cached_full_blocks_and_leaves_a_token_to_compute():
    sched = create_scheduler(reuse=True)
    prefix = list(range(100, 112))  # 3 full blocks
    [a] = create_requests(1, prompt=prefix + [1, 2], max_tokens=2)
    sched.add(a)
    run_all(sched)
    [b] = create_requests(1, prompt=prefix + [3], max_tokens=2)
    sched.add(b)
    first = step(sched)
    assert first == {b.request_id: 1}
    assert b.num_cached_tokens == 12
    run_all(sched)
    [c] = create_requests(1, prompt=prefix, max_tokens=1)  # all cached: the last block is recomputed
    sched.add(c)
    assert step(sched) == {c.request_id: 4}
    stats = sched.blocks.stats
    assert (stats.lookups, stats.hits, stats.reused_tokens) == (3, 2, 20)


def test_reuse_off_per_request_skips_lookup_and_publication():
    sched = create_scheduler(reuse=True)
    prompt = list(range(200, 216))
    [a] = create_requests(1, prompt=prompt, max_tokens=2, reuse_context=False)
    sched.add(a)
    run_all(sched)
    assert sched.blocks.num_records == 0
    [b] = create_requests(1, prompt=prompt, max_tokens=2)
    sched.add(b)
    run_all(sched)
    [c] = create_requests(1, prompt=prompt + [1], max_tokens=2, reuse_context=False)
    sched.add(c)
    assert step(sched) == {c.request_id: 17}
    assert sched.blocks.stats.lookups == 1


def test_cache_generated_tokens_false_publishes_the_prompt_only():
    for generated, records in ((True, 4), (False, 2)):
        sched = create_scheduler(reuse=True)
        [a] = create_requests(1, prompt=list(range(300, 308)), max_tokens=9, cache_generated_tokens=generated)
        sched.add(a)
        run_all(sched)
        assert sched.blocks.num_records == records  # 16 computed tokens = 4 blocks; the prompt is 2


def test_records_are_lru_bounded_by_max_records():
    sched = create_scheduler(reuse=True, max_records=3)
    for base in (400, 500):
        [seq] = create_requests(1, prompt=list(range(base, base + 9)), max_tokens=1)
        sched.add(seq)
        run_all(sched)
    assert sched.blocks.num_records == 3
    assert sched.blocks.stats.evictions == 1
    [again] = create_requests(1, prompt=list(range(400, 409)), max_tokens=1)
    sched.add(again)
    step(sched)
    assert again.num_cached_tokens == 0  # its first block was the least recently used record


def test_records_give_way_when_blocks_are_needed():
    sched = create_scheduler(num_blocks=4, reuse=True)
    [a] = create_requests(1, prompt=list(range(600, 613)), max_tokens=1)  # 13 tokens: 3 records
    sched.add(a)
    run_all(sched)
    assert sched.blocks.num_records == 3 and sched.blocks.num_free_blocks == 4
    [b] = create_requests(1, prompt=list(range(700, 714)), max_tokens=1)  # needs all 4 blocks
    sched.add(b)
    run_all(sched)
    assert b.is_finished and sched.blocks.stats.evictions >= 3


def test_shared_prefix_blocks_are_reference_counted():
    sched = create_scheduler(reuse=True, num_blocks=16)
    prompt = list(range(800, 810))
    [a] = create_requests(1, prompt=prompt, max_tokens=8)
    sched.add(a)
    step(sched)
    [b] = create_requests(1, prompt=prompt, max_tokens=8)
    sched.add(b)
    step(sched)
    assert b.block_table[:2] == a.block_table[:2]
    assert sched.blocks.blocks[a.block_table[0]].ref_count == 2
    sched.finish(a, "cancelled")
    assert sched.blocks.blocks[b.block_table[0]].ref_count == 1
    run_all(sched)
    assert sched.blocks.num_free_blocks == 16


def test_share_prompt_forks_full_prompt_blocks_only():
    blocks = BlockManager(16, BLOCK)
    [leader] = create_requests(1, prompt_len=10)
    blocks.grow(leader, 10)
    leader.num_computed_tokens = 10
    [sibling] = create_requests(1, prompt=leader.token_ids)
    blocks.share_prompt(leader, sibling)
    assert sibling.block_table == leader.block_table[:2]
    assert sibling.num_computed_tokens == 8
    assert blocks.num_free_blocks == 13
    blocks.release(leader)
    assert blocks.num_free_blocks == 14
    blocks.release(sibling)
    assert blocks.num_free_blocks == 16


@pytest.mark.parametrize("ifb", [True, False])
def test_many_random_requests_all_finish_and_free_the_pool(ifb):
    import random

    rng = random.Random(ifb)
    sched = create_scheduler(num_blocks=12, max_batch_size=5, max_num_batched_tokens=24, ifb=ifb, reuse=True)
    seqs = []
    for i in range(40):
        [seq] = create_requests(
            1, prompt_len=rng.randint(1, 20), max_tokens=rng.randint(1, 20), priority=i % 3
        )
        seqs.append(seq)
        sched.add(seq)
        if i % 4 == 0:
            step(sched)
    run_all(sched)
    assert all(len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert sched.blocks.num_free_blocks == 12
    assert all(b.ref_count == 0 for b in sched.blocks.blocks)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_shared_prefixes_with_preemption_and_eviction_never_corrupt_a_block(seed):
    """A fake KV pool records which token each slot holds; every sequence must always read its own
    tokens through its block table, whatever was shared, evicted, preempted or recomputed."""
    import random

    rng = random.Random(3)
    sched = create_scheduler(
        num_blocks=14, max_batch_size=4, max_num_batched_tokens=16, reuse=True, max_records=8
    )
    kv = {b: [None] * BLOCK for b in range(14)}
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    seqs = []
    for _ in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
        [seq] = create_requests(1, prompt=prompt, max_tokens=rng.randint(1, 20), priority=rng.randint(0, 1))
        seqs.append(seq)
        sched.add(seq)
    preemptions = 0
    while sched.has_work:
        batch = sched.schedule()
        preemptions += len(batch.preempted)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            for p in range(start, start + n):
                kv[seq.block_table[p // BLOCK]][p % BLOCK] = seq.token_ids[p]
            seq.num_computed_tokens += n
            assert all(
                kv[seq.block_table[p // BLOCK]][p % BLOCK] == seq.token_ids[p] for p in range(start + n)
            ), seq
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                sched.blocks.publish(seq)
                seq.token_ids.append(rng.randrange(50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
    assert preemptions > 0 and sched.blocks.stats.hits > 0 and sched.blocks.stats.evictions > 0
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.blocks.num_free_blocks == 14


def test_whole_drafts_are_never_split_across_steps():
    """Hybrid models keep a draft and the token before it in one step: a chunk that would end inside
    them ends before them; with nothing before them and too small a budget, the draft is dropped."""
    blocks = BlockManager(64, BLOCK)
    sched = Scheduler(SchedulerConfig(1, 12, whole_drafts=True), blocks)
    seq = Sequence(list(range(10)), SamplingParams(max_tokens=8))
    seq.token_ids += [50, 51, 52]  # e.g. a preempted sequence recomputing with its draft
    seq.num_draft_tokens = 3
    sched.add(seq)
    batch = sched.schedule()
    assert batch.num_tokens == [9]  # not 12: the window (position 9 and the draft) starts at 9
    seq.num_computed_tokens += 9
    sched.config = SchedulerConfig(1, 3, whole_drafts=True)
    assert sched.schedule().num_tokens == [1]  # 4 window tokens do not fit 3: the draft is dropped
    assert seq.token_ids == list(range(10)) and seq.num_draft_tokens == 0
    seq.num_computed_tokens += 1

    other = Sequence(list(range(4)), SamplingParams(max_tokens=8))
    other.token_ids += [60, 61]
    other.num_draft_tokens = 2
    sched = Scheduler(SchedulerConfig(1, 3, whole_drafts=True), BlockManager(64, BLOCK))
    sched.add(other)
    assert sched.schedule().num_tokens == [3]  # the whole window fits after the prompt chunk
    other.num_computed_tokens += 3
    assert sched.schedule().num_tokens == [3] and other.num_draft_tokens == 2

    plain = Scheduler(SchedulerConfig(1, 12), BlockManager(64, BLOCK))
    third = Sequence(list(range(10)), SamplingParams(max_tokens=8))
    third.token_ids += [50, 51, 52]
    third.num_draft_tokens = 3
    plain.add(third)
    assert plain.schedule().num_tokens == [12]  # other models may split a draft (they recompute nothing)


# ---- SchedulerOutput: the schedule as plain data ---------------------------------------------------
def test_scheduler_output_is_plain_data_keyed_by_request_id():
    sched = create_scheduler(max_num_batched_tokens=16)
    a, b = create_requests(2, prompt_len=12, max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule().output
    # a prefills whole, b gets the budget's last 4 tokens
    assert out.num_scheduled_tokens == {a.request_id: 12, b.request_id: 4}
    assert out.total_num_scheduled_tokens == 16 and out.num_draft_tokens == {}
    assert out.new == (a.request_id, b.request_id) and out.resumed == out.preempted == out.finished == ()
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in out.num_scheduled_tokens.items())
    with pytest.raises(AttributeError):
        out.new = ()  # frozen
    a.num_computed_tokens, b.num_computed_tokens = 12, 4
    a.token_ids.append(7)
    out = sched.schedule().output
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 8} and out.new == ()


def test_scheduler_output_reports_preemption_resumption_and_finishes_once():
    sched = create_scheduler(num_blocks=6, max_batch_size=2, max_num_batched_tokens=64)
    a, b = create_requests(2, prompt_len=8, max_tokens=20)  # 2 blocks each; growth runs out of blocks
    sched.add(a)
    sched.add(b)
    outputs = []
    while not any(o.preempted for o in outputs):
        batch = sched.schedule()
        outputs.append(batch.output)
        assert list(batch.output.num_scheduled_tokens) == [s.request_id for s in batch.seqs]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
        assert len(outputs) < 50
    victim = outputs[-1].preempted[0]
    assert victim == b.request_id and victim not in outputs[-1].num_scheduled_tokens
    sched.finish(a, "stop")  # frees a's blocks: b is re-admitted, recomputed from its start
    out = sched.schedule().output
    assert out.finished == (a.request_id,) and out.resumed == (b.request_id,) and out.new == ()
    assert out.num_scheduled_tokens[b.request_id] == b.num_tokens  # the prompt and its outputs so far
    assert sched.schedule().output.finished == ()  # reported once


# ---- update_from_output: the step's bookkeeping on plain data ---------------------------------------
def run_step(sched: Scheduler, sample) -> tuple:
    """Schedule; the "runner" advances computed tokens (as ModelRunner.execute does) and samples
    ``sample(seq)`` for each sequence that caught up; the scheduler keeps them."""
    from trtedge.runtime.core.outputs import ModelRunnerOutput

    batch = sched.schedule()
    sampled = {}
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens >= seq.num_tokens:
            sampled[seq.request_id] = tuple(sample(seq))
    return batch.output, sched.update_from_output(ModelRunnerOutput(sampled))


def test_update_from_output_keeps_tokens_and_stops_at_eos_stop_ids_and_length():
    blocks = BlockManager(64, BLOCK)
    sched = Scheduler(
        SchedulerConfig(4, 64, enable_in_flight_batching=True, eos_token_ids=frozenset({2})), blocks
    )
    eos, stop_id, length, ignoring = (
        Sequence([5] * 6, SamplingParams(max_tokens=10)),
        Sequence([5] * 6, SamplingParams(max_tokens=10, stop_token_ids=[9])),
        Sequence([5] * 6, SamplingParams(max_tokens=2)),
        Sequence([5] * 6, SamplingParams(max_tokens=2, ignore_eos=True)),
    )
    for seq in (eos, stop_id, length, ignoring):
        sched.add(seq)
    picks = {
        eos.request_id: [7, 2],
        stop_id.request_id: [9],
        length.request_id: [7, 7],
        ignoring.request_id: [2, 2],
    }
    _, first = run_step(sched, lambda s: [picks[s.request_id].pop(0)])
    assert [(u.new_token_ids, u.finish_reason, u.stop_token) for u in first] == [
        ((7,), None, False),
        ((9,), "stop", True),
        ((7,), None, False),
        ((2,), None, False),  # EOS ignored
    ]
    assert stop_id.output_ids == [9] and not stop_id.is_finished  # the caller finishes it
    sched.finish(stop_id, "stop")
    _, second = run_step(sched, lambda s: [picks[s.request_id].pop(0)])
    assert {u.request_id: (u.finish_reason, u.stop_token) for u in second} == {
        eos.request_id: ("stop", True),
        length.request_id: ("length", False),
        ignoring.request_id: ("length", False),
    }


def test_update_from_output_verifies_a_draft_and_frees_the_rejected_positions():
    sched = create_scheduler(num_blocks=16, max_num_batched_tokens=64)
    (seq,) = create_requests(1, prompt_len=6, max_tokens=20)
    sched.add(seq)
    run_step(sched, lambda s: [30])  # prefill, then a 5-token jump-forward draft after the sample
    seq.token_ids += [31, 32, 33, 34, 35]
    seq.num_draft_tokens = 5
    out, (update,) = run_step(sched, lambda s: [31, 32, 99, 40, 41, 42])  # agrees with 2 of 5
    assert out.num_scheduled_tokens == {seq.request_id: 6} and out.num_draft_tokens == {seq.request_id: 5}
    assert update.new_token_ids == (31, 32, 99) and update.num_accepted_draft == 2 and update.rolled_back
    assert seq.output_ids == [30, 31, 32, 99] and seq.num_draft_tokens == 0
    assert seq.num_computed_tokens == 9  # the prompt, 30, 31, 32: 99 is the next input
    assert len(seq.block_table) == sched.blocks.blocks_needed(9)  # the rejected positions' block went back
    assert update.finish_reason is None


def test_update_from_output_applies_the_guide_and_skips_finished_requests():
    class Matcher:  # accepts tokens below 100 and ends after token 50
        def __init__(self):
            self.done = False

        def accept_token(self, token):
            self.done = token == 50
            return token < 100

        def is_terminated(self):
            return self.done

    sched = create_scheduler()
    a, b, c = create_requests(3, prompt_len=5, max_tokens=10)
    a.matcher, b.matcher = Matcher(), Matcher()
    for seq in (a, b, c):
        sched.add(seq)
    picks = {a.request_id: 150, b.request_id: 50, c.request_id: 7}
    _, updates = run_step(sched, lambda s: [picks[s.request_id]])
    by_id = {u.request_id: u for u in updates}
    assert by_id[a.request_id].rejected == 150 and by_id[a.request_id].new_token_ids == ()
    assert by_id[a.request_id].finish_reason == "stop" and a.num_output_tokens == 0
    assert by_id[b.request_id].finish_reason == "stop" and by_id[b.request_id].stop_token
    sched.finish(c, "cancelled")  # cancelled while its next step ran: its samples are dropped
    from trtedge.runtime.core.outputs import ModelRunnerOutput

    assert sched.update_from_output(ModelRunnerOutput({c.request_id: (8,)})) == []
    assert c.output_ids == [7] and sched.get(c.request_id) is None


def test_a_request_id_in_flight_is_refused_and_free_again_once_finished():
    sched = create_scheduler()
    (a,) = create_requests(1)
    twin = Sequence([1, 2, 3], SamplingParams(), request_id=a.request_id)
    sched.add(a)
    with pytest.raises(ValueError, match="request_id .* already in use"):
        sched.add(twin)
    sched.finish(a, "stop")
    sched.add(twin)
    assert sched.get(a.request_id) is twin


def test_model_runner_output_groups_a_requests_rows():
    from trtedge.runtime.core.outputs import ModelRunnerOutput

    out = ModelRunnerOutput.from_rows(["a", "b", "b", "b"], [1, 2, 3, 4], [None, "x", None, "y"])
    assert out.sampled_token_ids == {"a": (1,), "b": (2, 3, 4)}
    assert out.logprobs == {"b": ("x", None, "y")}
