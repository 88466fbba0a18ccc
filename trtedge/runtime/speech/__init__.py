"""Speech output of Qwen3-Omni: the Talker, its code predictor and Code2Wav (the bundle's ``talker``,
``code_predictor`` and ``code2wav`` components), run by the front end beside the engine: the engine
generates the answer's text, then ``pipeline.SpeechPipeline`` speaks it (``api`` holds what ``LLM``
calls, ``encode`` the response formats). No torch at import time."""

from __future__ import annotations


def speech_tensor_names(name: str) -> str | None:
    """The speech component a checkpoint tensor belongs to: "talker", "code_predictor", "code2wav", or None."""
    if name.startswith("talker.code_predictor."):
        return "code_predictor"
    if name.startswith("talker."):
        return "talker"
    if name.startswith("code2wav."):
        return "code2wav"
    return None
