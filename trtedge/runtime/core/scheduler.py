"""Token-budget scheduling with in-flight batching, priorities and preemption (no tensors here).

Each step every scheduled sequence's computed tokens catch up with its total: a new prompt
computes in chunks up to the token budget, a running sequence computes its one new token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput
from trtedge.runtime.core.request import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 1
    max_num_batched_tokens: int = 2048
    enable_in_flight_batching: bool = False
    whole_drafts: bool = False  # hybrid models: a jump-forward draft is never split across steps
    max_seq_len: int | None = None  # tokens a sequence may reach (max_kv_cache_capacity)
    eos_token_ids: frozenset[int] = frozenset()  # stop a request (unless it ignores EOS)


@dataclass(frozen=True)
class SchedulerOutput:
    """A step's schedule as plain data, keyed by request id: what a runner in another process, a
    tensor-parallel rank or a test reads (no live objects). The engine's runner still takes the
    step's sequences (``ScheduledBatch.seqs``); this is the description they are moving to. Its
    results come back as a ``ModelRunnerOutput`` to ``Scheduler.update_from_output``."""

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
        self._live: dict[str, Sequence] = {}  # request id -> every sequence not finished

    def add(self, seq: Sequence) -> None:
        if self._live.get(seq.request_id, seq) is not seq:
            raise ValueError(f"request_id {seq.request_id!r} is already in use by a request in flight")
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._live[seq.request_id] = seq

    def adopt(self, waiting: list[Sequence]) -> None:
        """Take over another scheduler's waiting sequences (an engine restart keeps its queue)."""
        for seq in waiting:
            self.add(seq)

    def get(self, request_id: str) -> Sequence | None:
        """The sequence of a request that has not finished."""
        return self._live.get(request_id)

    def update_from_output(self, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """A step's bookkeeping: each request keeps its sampled tokens, a jump-forward draft's up to
        the first one the model did not agree with (the rejected positions cut from the KV cache), a
        guided request's as far as its guide accepts them, and stops at EOS, a stop token id, the
        guide's end or its length limit. A request that finished while its step ran is skipped.
        Returns what each request kept and why it stops; the caller finishes those that stop (its
        text may stop one earlier, at a stop string)."""
        updates = []
        for request_id, ids in output.sampled_token_ids.items():
            seq = self._live.get(request_id)
            if seq is None or seq.is_finished:
                continue
            updates.append(self._keep(seq, ids, output.logprobs.get(request_id, ())))
        return updates

    def _keep(self, seq: Sequence, ids: tuple[int, ...], infos: tuple) -> EngineCoreOutput:
        k = seq.num_draft_tokens
        if not k and len(ids) == 1 and seq.matcher is None:  # a plain decode row: the loop below, once
            seq.token_ids.append(ids[0])
            reason, stop_token = self._stop_reason(seq, ids[0])
            return EngineCoreOutput(seq.request_id, ids, tuple(infos[:1]), reason, stop_token)
        draft: list[int] = []
        if k:  # the samples of a draft's k positions and the one after them
            draft = seq.token_ids[len(seq.token_ids) - k :]
            del seq.token_ids[len(seq.token_ids) - k :]
            seq.num_draft_tokens = 0
            seq.num_computed_tokens = len(seq.token_ids)
            if len(ids) != k + 1:  # split across steps (never on hybrid models): drop it, decode on
                seq.num_computed_tokens -= 1
                ids = ()
        kept: list[int] = []
        reason, stop_token, rejected, agreed_count = None, False, None, 0
        for j, token in enumerate(ids):
            if k:
                seq.num_computed_tokens = len(seq.token_ids)  # the KV of every token before this one holds
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                rejected, reason = (
                    token,
                    "stop",
                )  # only an allowed token can be sampled: the guide had no way on
                break
            seq.token_ids.append(token)
            kept.append(token)
            reason, stop_token = self._stop_reason(seq, token)
            agreed = bool(k) and j < k and token == draft[j]
            agreed_count += agreed
            if reason is not None or (k and not agreed):
                break
        rolled_back = bool(k) and reason is None
        if rolled_back:  # the rejected draft positions: their blocks go back
            self.blocks.truncate(seq, seq.num_computed_tokens)
        return EngineCoreOutput(
            seq.request_id,
            tuple(kept),
            tuple(infos[: len(kept)]),
            reason,
            stop_token,
            rejected,
            agreed_count,
            rolled_back,
        )

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str | None, bool]:
        """(finish reason or None, whether ``token`` stopped it as a stop token) after ``token``."""
        params = seq.params
        if (
            not params.ignore_eos
            and token in self.config.eos_token_ids
            or token in params.stop_token_ids
            or (seq.matcher is not None and seq.matcher.is_terminated())
        ):
            return "stop", True
        limit = self.config.max_seq_len
        if seq.num_output_tokens >= params.max_tokens or (limit is not None and seq.num_tokens >= limit):
            return "length", False
        return None, False

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
        if self._live.get(seq.request_id) is seq:
            del self._live[seq.request_id]
