"""Speech of `trtedge chat` answers (`/speak on`, `/save-audio PATH`): WAV files of a backend's 24 kHz
float32 audio, and playing one with the first player found on the PATH."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000
# (program, arguments before the file): the first one installed plays the answer
PLAYERS = (
    ("aplay", ["-q"]),
    ("paplay", []),
    ("afplay", []),
    ("ffplay", ["-nodisp", "-autoexit", "-loglevel", "quiet"]),
)


def wav_bytes(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    from trtedge.runtime.speech.encode import pcm16, wav_header

    return wav_header(audio.shape[0], sample_rate) + pcm16(audio)


def save_wav(path: Path, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    path.write_bytes(wav_bytes(audio, sample_rate))


def find_player() -> list[str] | None:
    for program, args in PLAYERS:
        found = shutil.which(program)
        if found:
            return [found, *args]
    return None


def play(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> str | None:
    """Play ``audio`` to the end (Ctrl-C stops it); an error message for the user, or None."""
    player = find_player()
    if player is None:
        names = ", ".join(p for p, _ in PLAYERS)
        return f"no audio player found ({names}); /save-audio PATH writes the answer as a WAV file"
    with tempfile.TemporaryDirectory(prefix="trtedge-speech-") as tmp:
        path = Path(tmp) / "answer.wav"
        save_wav(path, audio, sample_rate)
        try:
            done = subprocess.run([*player, str(path)], capture_output=True, check=False)
        except KeyboardInterrupt:
            return None
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [
                f"exit {done.returncode}"
            ]
            return f"{Path(player[0]).name} could not play the answer: {why[0]}"
    return None
