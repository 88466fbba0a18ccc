"""A request inside the engine: its tokens, progress, blocks and status (no tensors here)."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto

from trtedge.runtime.sampling_params import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, priority: int = 0, request_id: str | None = None
    ):
        self.seq_id = next(_ids)
        self.request_id = request_id or f"seq-{self.seq_id}"
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.priority = priority
        self.arrival = time.monotonic()
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        # Sampled on the device, not yet read by the host (asynchronous scheduling): the next step
        # computes them (their ids come from the device) before ``token_ids`` holds them.
        self.num_inflight = 0
        self.num_cached_tokens = 0  # prompt tokens taken from the context cache
        self.block_table: list[int] = []
        self.partial_restore: tuple[int, int] | None = None  # (snapshot entry, rows) a cache hit copies in
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.seed = params.seed if params.seed is not None else 0
        self.matcher = None  # an xgrammar GrammarMatcher when the request is guided
        self.spec_stats = None  # speculative.SpecStats once a draft of this sequence was verified
        self.num_draft_tokens = 0  # trailing token_ids proposed by jump-forward, not yet verified
        self.num_forward_passes = 0
        # Prompt logprobs still to compute in the prefill: how many top alternatives (None: none wanted).
        self.prompt_logprobs: int | None = None
        # Hybrid models (recurrent layers): the state slot, and positions of its saved checkpoint.
        self.state_slot: int | None = None
        self.checkpoint_limit = 0  # furthest position to checkpoint at; 0: never
        self.checkpoint_pos = 0
        self.published_pos = 0
        self.restore_entry: int | None = None  # snapshot to resume from, set by a context-cache hit
        # Vision-language prompts: the MultimodalPrompt (media items, M-RoPE positions) and the
        # encoder embeddings of its items while the prompt is being prefilled (runner-owned).
        self.mm = None
        self.mm_embeds: dict = {}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
