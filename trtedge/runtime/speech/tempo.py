"""Speech faster or slower at the same pitch: FFmpeg's atempo filter through PyAV, fed piece by piece
(``speed`` in [0.25, 4]: factors past atempo's [0.5, 2] are chained)."""

from __future__ import annotations

import numpy as np


def factors(speed: float) -> list[float]:
    out = []
    while speed < 0.5:
        out.append(0.5)
        speed /= 0.5
    while speed > 2.0:
        out.append(2.0)
        speed /= 2.0
    return [*out, speed]


class Tempo:
    def __init__(self, speed: float, sample_rate: int):
        import av.filter

        self.rate = sample_rate
        self._pts = 0
        self._graph = av.filter.Graph()
        chain = [self._graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono")]
        chain += [self._graph.add("atempo", f"{f:.6f}") for f in factors(speed)]
        chain.append(self._graph.add("abuffersink"))
        for a, b in zip(chain, chain[1:]):
            a.link_to(b)
        self._graph.configure()

    def feed(self, samples: np.ndarray) -> np.ndarray:
        import av

        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples, np.float32)[None], format="flt", layout="mono"
        )
        frame.sample_rate, frame.pts = self.rate, self._pts
        self._pts += samples.shape[0]
        self._graph.push(frame)
        return self._drain()

    def finish(self) -> np.ndarray:
        self._graph.push(None)
        return self._drain()

    def _drain(self) -> np.ndarray:
        import av

        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32))
        return np.concatenate(out) if out else np.zeros(0, np.float32)
