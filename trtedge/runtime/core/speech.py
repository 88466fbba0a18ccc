"""Speech sequences: the Talker's work as the engine schedules it, one codec frame per sequence and
step. No tensors here: the speech runner (``runtime.speech.runner``) owns the Talker's caches and
Code2Wav.

A sequence speaks the answer of a conversation: ``num_text_rows`` counts the text rows the Talker
can read (the answer's tokens after its first four, then ``tts_eos`` once the text is complete,
``text_done``). Frame ``k`` (k >= 1) is made after the Talker reads row ``k - 1``, so a sequence whose
answer is still being generated waits, without a step, until that row exists or the text ends."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_ids = itertools.count()


@dataclass(eq=False)
class SpeechSequence:
    prompt_ids: list[int]  # the conversation the Talker reads, up to the answer known at submission
    voice: str
    sampling: Any  # TalkerSampling: temperature, top-k, top-p, repetition penalty, max_frames, seed
    chunk_frames: int  # frames per Code2Wav piece
    num_text_rows: int  # rows of the answer's text the Talker can read now (tts_eos included once done)
    text_done: bool  # the answer is complete (its tts_eos counted)
    seq_id: int = field(default_factory=lambda: next(_ids))
    text_ids: list[int] = field(default_factory=list)  # answer tokens pushed after submission
    num_frames: int = 0
    finish_reason: str | None = None

    @property
    def is_ready(self) -> bool:
        """The next frame can be made now (its text row is there, or the text has ended)."""
        return self.num_frames == 0 or self.text_done or self.num_frames <= self.num_text_rows

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def push_text(self, token_ids: list[int]) -> None:
        if not self.text_done:
            self.text_ids.extend(token_ids)
            self.num_text_rows += len(token_ids)

    def end_text(self) -> None:
        if not self.text_done:
            self.text_done = True
            self.num_text_rows += 1  # tts_eos


class SpeechScheduler:
    """Waiting and running speech sequences; at most ``max_num_seqs`` run (hold Talker caches)."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max(1, max_num_seqs)
        self.waiting: deque[SpeechSequence] = deque()
        self.running: list[SpeechSequence] = []

    @property
    def num_seqs(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        """A step would make a frame (a sequence waiting only for text is no work)."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return True
        return any(s.is_ready for s in self.running)

    def add(self, seq: SpeechSequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[SpeechSequence]:
        """The sequences that make a frame this step, the newly admitted ones included."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())
        return [s for s in self.running if s.is_ready]

    def finish(self, seq: SpeechSequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


@dataclass(frozen=True)
class SpeechDelta:
    """A piece of a speech's audio (float32 mono samples, or None) and, on the last, why it ended
    ("stop": the Talker ended it or reached max_frames; "cancelled"; "error")."""

    audio: Any
    num_frames: int
    finish_reason: str | None
