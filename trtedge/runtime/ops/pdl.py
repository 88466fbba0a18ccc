"""Hopper's programmatic dependent launch (PDL) for the decode-step kernels: a kernel launched with
it may start while the kernel before it on the stream still runs, so its launch and scheduling
overlap that kernel's tail (a decode step of a small model is ~150 kernels of a few microseconds).

Every kernel launched with it calls ``gdc_wait`` before its first read, in every program, and that
wait returns once the previous kernel has finished and its writes are visible; since the previous
kernel waited the same way, a kernel also sees every kernel before it. Kernels call
``gdc_launch_dependents`` once their main loop is done. On with ``TRTEDGE_PDL=1`` (off by default:
on the H200 it has not yet measured faster), and then only from sm_90, not under the Triton
interpreter, and where a CUDA graph with PDL launches captures and replays correctly."""

from __future__ import annotations

import logging
import os

import torch

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None

log = logging.getLogger("trtedge")
_enabled: bool | None = None

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _probe_kernel(x_ptr, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_wait()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        tl.extra.cuda.gdc_launch_dependents()
        tl.store(x_ptr + offs, x + 1.0)


def enabled() -> bool:
    """Whether the decode kernels launch with PDL (probed once, outside any graph capture)."""
    global _enabled
    if _enabled is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        _enabled = _probe()
    return _enabled


def _probe() -> bool:
    if (
        triton is None
        or not torch.cuda.is_available()
        or os.environ.get("TRTEDGE_PDL", "0") != "1"
        or os.environ.get("TRITON_INTERPRET", "0") == "1"
        or torch.cuda.get_device_capability() < (9, 0)
    ):
        return False
    try:
        x = torch.zeros(4 * 256, device="cuda")
        _probe_kernel[(4,)](x, BLOCK=256, launch_pdl=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(8):
                _probe_kernel[(4,)](x, BLOCK=256, launch_pdl=True)
        graph.replay()
        torch.cuda.synchronize()
        ok = bool((x == 9.0).all())
    except Exception as e:  # an older driver or Triton: launch without it
        log.info("programmatic dependent launch unavailable (%s)", e)
        return False
    if not ok:
        log.warning("programmatic dependent launch gave a wrong result in a CUDA graph; not used")
    return ok
