"""The Talker as the engine's own sequences: speech is submitted to the engine (``submit_speech``),
whose thread makes one codec frame per running speech sequence between the thinker's steps, so
speeches and text requests share the engine and each speech's audio is what it is alone; a live
speech waits, taking no step, for text still being generated; cancelling frees its Talker state."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.runtime.test_qwen3_omni_speech import GREEDY, PROMPT
from tests.tiny_omni import make_tiny_qwen3_omni_speech

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_omni_speech(tmp_path_factory.mktemp("qwen3_omni_speech"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(
        str(checkpoint),
        max_kv_cache_capacity=256,
        max_input_len=128,
        dtype="float32",
        max_batch_size=4,
        enable_in_flight_batching=True,
    ) as llm:
        yield llm


def _idle(llm) -> bool:
    return llm.engine.num_active == 0 and llm.engine.speech.num_states == 0


def test_the_scheduler_runs_a_sequence_only_when_its_next_text_row_is_there():
    from trtedge.runtime.core.speech import SpeechScheduler, SpeechSequence

    sched = SpeechScheduler(max_num_seqs=1)
    live = SpeechSequence([1, 2, 3], "ethan", None, chunk_frames=5, num_text_rows=1, text_done=False)
    other = SpeechSequence([1, 2, 3], "ethan", None, chunk_frames=5, num_text_rows=3, text_done=True)
    sched.add(live)
    sched.add(other)
    assert sched.schedule() == [live]  # one seat: the second waits for it
    live.num_frames = 2  # frame 2 reads text row 1, not made yet
    assert sched.schedule() == [] and not sched.has_work
    live.push_text([7])
    assert sched.schedule() == [live]
    live.num_frames = 5
    live.end_text()  # past the text the Talker pads: every frame can be made
    assert live.num_text_rows == 3 and sched.schedule() == [live]
    sched.finish(live, "stop")
    assert sched.schedule() == [other] and live.is_finished


def test_speeches_and_text_share_the_engine_and_each_speaks_as_alone(llm):
    from trtedge import SamplingParams

    text = "w5 w6 w7"
    alone = np.concatenate(list(llm.speech_stream(text, voice="chelsie", codec_chunk_frames=2, **GREEDY)))
    steps = llm.stats().steps
    streams = [llm.speech_stream(text, voice="chelsie", codec_chunk_frames=2, **GREEDY) for _ in range(3)]
    heads = [next(s) for s in streams]  # all three sequences are running in the engine now
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))  # a text request meanwhile
    assert len(out.token_ids) == 8 and llm.stats().steps > steps
    for head, stream in zip(heads, streams):
        np.testing.assert_allclose(np.concatenate([head, *stream]), alone, atol=1e-5, rtol=0)
    assert _idle(llm)


def test_a_live_speech_waits_for_its_text_without_steps_and_a_cancel_frees_it(llm):
    from trtedge.runtime.speech.api import SpeechOptions

    options = SpeechOptions(voice="chelsie", codec_chunk_frames=1, **GREEDY)
    answer = [10, 11, 12, 13]  # with <|im_start|>assistant: four for the Talker's prompt, two text rows
    stream = llm.engine.submit_speech(
        PROMPT + answer, "chelsie", options.sampling(12.5), options.codec_chunk_frames, live=True
    )
    got = [next(stream) for _ in range(3)]  # frames 0..2 read the prompt and text rows 0, 1
    assert [d.num_frames for d in got] == [1, 2, 3]
    time.sleep(0.3)  # no text row 2 yet: the sequence makes no frame
    (seq,) = llm.engine.speech_scheduler.running
    assert seq.num_frames == 3 and not seq.is_ready and not llm.engine.speech_scheduler.has_work
    stream.push_text([16])
    assert next(stream).num_frames == 4
    stream.cancel()
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    deadline = time.monotonic() + 10
    while not _idle(llm) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _idle(llm)


def test_a_dropped_stream_stops_its_talker(llm):
    stream = llm.speech_stream("w5 w6 w7", voice="chelsie", codec_chunk_frames=1, max_audio_length=60)
    next(stream)
    del stream  # a consumer that went away without closing
    deadline = time.monotonic() + 10
    while not _idle(llm) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _idle(llm)


def test_a_failing_talker_step_fails_that_speech_only(llm, monkeypatch):
    from trtedge.runtime.engine import EngineError

    runner = llm.engine.speech
    step = runner.step
    calls = []

    def broken(seq):
        calls.append(seq.seq_id)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return step(seq)

    monkeypatch.setattr(runner, "step", broken)
    with pytest.raises(EngineError, match="the Talker failed .*device fault"):
        list(llm.speech_stream("w5 w6 w7", voice="chelsie", codec_chunk_frames=1, **GREEDY))
    assert _idle(llm)
    again = list(llm.speech_stream("w5 w6 w7", voice="chelsie", codec_chunk_frames=1, **GREEDY))
    assert len(again) > 3  # the engine speaks on


def test_a_model_that_speaks_keeps_its_engine_core_in_this_process(llm, checkpoint):
    from trtedge import LLM
    from trtedge.config import ConfigError

    assert not llm.engine_process and llm.engine.speech is not None
    with pytest.raises(ConfigError, match="engine_process is not supported with .*speech output"):
        LLM(str(checkpoint), max_kv_cache_capacity=256, dtype="float32", engine_process=True)
