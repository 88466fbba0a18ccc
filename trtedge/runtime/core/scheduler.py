"""Token-budget scheduling with in-flight batching, priorities and preemption (no tensors here).

Each step every scheduled sequence's computed tokens catch up with its total: a new prompt
computes in chunks up to the token budget, a running sequence computes its one new token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.request import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 1
    max_num_batched_tokens: int = 2048
    enable_in_flight_batching: bool = False
    whole_drafts: bool = False  # hybrid models: a jump-forward draft is never split across steps
    max_seq_len: int | None = None  # tokens a sequence may reach (max_kv_cache_capacity)


@dataclass(frozen=True)
class SchedulerOutput:
    """A step's schedule as plain data, keyed by request id: what a runner in another process, a
    tensor-parallel rank or a test reads (no live objects). The engine's runner still takes the
    step's sequences (``ScheduledBatch.seqs``); this is the description they are moving to."""

    num_scheduled_tokens: dict[str, int]  # tokens to compute this step, jump-forward drafts included
    num_draft_tokens: dict[str, int]  # of those, draft tokens (only requests that have some)
    new: tuple[str, ...] = ()  # scheduled for the first time
    resumed: tuple[str, ...] = ()  # scheduled again after a preemption (recomputed from the start)
    preempted: tuple[str, ...] = ()  # preempted by this step (their blocks are free, they wait)
    finished: tuple[str, ...] = ()  # finished since the last step (their blocks are free)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens to compute this step, per sequence
    preempted: list[Sequence] = field(default_factory=list)
    joined: int = 0  # sequences that joined while others were mid-generation
    output: SchedulerOutput | None = None  # the same schedule as plain data (from Scheduler.schedule)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._finished: list[str] = []  # request ids finished since the last schedule

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _capacity(self) -> int:
        return self.config.max_batch_size if self.config.enable_in_flight_batching else 1

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        # Highest priority first; FCFS within a priority.
        self.running.sort(key=lambda s: (-s.priority, s.arrival, s.seq_id))
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0 or self._reached_end(seq):  # preempted above
                continue
            n = self._chunk(seq, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        mid_flight = any(s.num_output_tokens > 0 for s in seqs)
        joined = 0
        self.waiting.sort(key=lambda s: (-s.priority, s.arrival, s.seq_id))
        admitted: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self._capacity() and not preempted:
            seq = self.waiting[0]
            self.blocks.lookup_prefix(seq)
            n = self._chunk(seq, budget)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self.blocks.release(seq)  # drop prefix references taken by the lookup
                seq.num_cached_tokens = 0
                break
            self.waiting.pop(0)
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            joined += int(mid_flight)
            admitted.append(seq)
        finished, self._finished = tuple(self._finished), []
        output = SchedulerOutput(
            {s.request_id: n for s, n in zip(seqs, counts)},
            {s.request_id: s.num_draft_tokens for s in seqs if s.num_draft_tokens},
            new=tuple(s.request_id for s in admitted if not s.num_preemptions),
            resumed=tuple(s.request_id for s in admitted if s.num_preemptions),
            preempted=tuple(s.request_id for s in preempted),
            finished=finished,
        )
        return ScheduledBatch(seqs, counts, preempted, joined, output)

    def _reached_end(self, seq: Sequence) -> bool:
        """A sample still on the device takes the sequence to its length limit: nothing more to compute
        (the host finishes it when it reads the sample)."""
        if not seq.num_inflight:
            return False
        total = seq.num_tokens + seq.num_inflight
        limit = self.config.max_seq_len
        return total - seq.num_prompt_tokens >= seq.params.max_tokens or (
            limit is not None and total >= limit
        )

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute within ``budget``. With ``whole_drafts``, a jump-forward draft and
        the token before it (whose states the recurrent layers keep one by one) fall in one step: a
        chunk that would end inside them ends before them, or, when nothing comes before them, the
        draft is dropped and the sequence decodes on."""
        n = min(seq.num_tokens + seq.num_inflight - seq.num_computed_tokens, budget)
        k = seq.num_draft_tokens
        if not self.config.whole_drafts or k == 0 or seq.num_computed_tokens + n == seq.num_tokens:
            return n
        window_start = seq.num_tokens - k - 1
        if seq.num_computed_tokens + n <= window_start:
            return n
        if seq.num_computed_tokens < window_start:
            return window_start - seq.num_computed_tokens
        if seq.num_computed_tokens > window_start:  # cannot happen: the draft is never split
            return n
        del seq.token_ids[seq.num_tokens - k :]
        seq.num_draft_tokens = 0
        return min(seq.num_tokens - seq.num_computed_tokens, budget)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished, cancelled or failed) and free its blocks."""
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.status is not Status.FINISHED:
            seq.status = Status.FINISHED
            self.blocks.release(seq)
            self._finished.append(seq.request_id)
