"""The device side of speech sequences (``runtime.core.speech``), run on the engine thread: per
sequence its ``TalkerRun`` (the Talker's and code predictor's caches), the text rows projected so
far, the frames made and where the next Code2Wav piece starts. ``step`` makes one frame; every
``chunk_frames`` frames (and at the end) Code2Wav turns the new frames into a piece of audio."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from trtedge.runtime.core.speech import SpeechSequence
from trtedge.runtime.speech.pipeline import SpeechPipeline
from trtedge.runtime.speech.talker import TalkerRun


@dataclass(eq=False)
class _State:
    run: TalkerRun
    rows: list[torch.Tensor]  # the answer's text rows the Talker reads, one a frame
    eos: torch.Tensor  # tts_eos's row, read after the text once it is complete
    num_projected: int = 0  # of the sequence's pushed text_ids
    has_eos: bool = False
    frames: list[list[int]] = field(default_factory=list)
    start: int = 0  # the first frame of the next piece


class SpeechRunner:
    def __init__(self, pipeline: SpeechPipeline):
        self.pipeline = pipeline
        self._states: dict[int, _State] = {}

    @property
    def num_states(self) -> int:
        return len(self._states)

    def step(self, seq: SpeechSequence) -> tuple[bool, np.ndarray | None]:
        """One frame of ``seq``: (whether the speech has ended, the audio ready now or None)."""
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = self._start(seq)
        else:
            state.run.advance(self._row(seq, state, seq.num_frames - 1))
        frame = state.run.frame()
        if frame is None:
            return True, self._piece(state) if len(state.frames) > state.start else None
        state.frames.append(frame)
        seq.num_frames += 1
        if len(state.frames) - state.start == seq.chunk_frames:
            return False, self._piece(state)
        return False, None

    def release(self, seq: SpeechSequence) -> None:
        self._states.pop(seq.seq_id, None)

    def _start(self, seq: SpeechSequence) -> _State:
        prompt = self.pipeline.prompt(seq.prompt_ids, seq.voice)
        run = TalkerRun(self.pipeline.talker, prompt.prefill, prompt.pad, seq.sampling)
        return _State(run, list(prompt.trailing[:-1]), prompt.trailing[-1])

    def _row(self, seq: SpeechSequence, state: _State, index: int) -> torch.Tensor | None:
        """Text row ``index`` (None past the text: the Talker pads)."""
        if state.num_projected < len(seq.text_ids):
            state.rows.extend(self.pipeline.project(seq.text_ids[state.num_projected :]))
            state.num_projected = len(seq.text_ids)
        if seq.text_done and not state.has_eos:
            state.rows.append(state.eos)
            state.has_eos = True
        return state.rows[index] if index < len(state.rows) else None

    def _piece(self, state: _State) -> np.ndarray:
        piece = self.pipeline.code2wav.chunk(state.frames, state.start)
        state.start = len(state.frames)
        return piece.cpu().numpy()
