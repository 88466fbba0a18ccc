"""A tensor-parallel worker rank: ``python -m trtedge.runtime.executor.tp_worker``, started by rank 0
(``tp.WorkerProcess``), which pickles (launch, rank, parent pid) onto its stdin."""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    from trtedge.runtime.executor.tp import serve_rank

    launch, rank, parent = pickle.load(sys.stdin.buffer)
    serve_rank(launch, rank, parent)


if __name__ == "__main__":
    main()
