"""Triton product for skinny activations (decode: at most 16 rows) with bf16/fp16 weights.

At batch 1 cuBLAS reads some decode-sized weights far below the H200's bandwidth (a Qwen3-0.6B
o_proj at 0.36 TB/s). Here each program streams one ``BLOCK_N x K/SPLIT_K`` slab of the weight
once; with split-K the last program of a column tile (found through an atomic counter, which it
resets for the next call or graph replay) sums the fp32 partials, adds the bias and stores.
Which tiling wins depends on the shape, so each weight times a few plans (and cuBLAS) once per
row bucket and keeps the fastest. ``F.linear`` is the oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtedge.runtime.ops.triton_attention import available, triton

MAX_ROWS = 16

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        part_ptr,
        count_ptr,
        M,
        N,
        K,
        stride_x,
        stride_w,
        stride_y,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        lo = pid_k * span
        hi = tl.minimum(lo + span, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_K):
            ks = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * stride_x + ks[None, :],
                mask=(rm[:, None] < M) & (ks[None, :] < hi),
                other=0.0,
            )
            w = tl.load(
                w_ptr + rn[:, None] * stride_w + ks[None, :],
                mask=(rn[:, None] < N) & (ks[None, :] < hi),
                other=0.0,
                eviction_policy="evict_first",
            )
            acc += tl.dot(x, tl.trans(w))
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K > 1:
            tile = BLOCK_M * N
            tl.store(part_ptr + pid_k * tile + rm[:, None] * N + rn[None, :], acc, mask=out_mask)
            done = tl.atomic_add(count_ptr + pid_n, 1)
            if done != SPLIT_K - 1:
                return
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(
                    part_ptr + s * tile + rm[:, None] * N + rn[None, :],
                    mask=out_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.atomic_xchg(count_ptr + pid_n, 0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# (BLOCK_N, BLOCK_K, SPLIT_K) candidates: the winners of `benchmarks/gpu_gemv.py --sweep` on the
# H200 across the Qwen3-0.6B and 8B projection shapes.
_CANDIDATES = (
    (32, 128, 1),
    (64, 128, 1),
    (64, 256, 1),
    (32, 128, 4),
    (32, 128, 8),
    (64, 128, 4),
    (128, 128, 4),
)
_MAX_SPLIT_TILES = 512  # wider weights have programs enough without split-K
# (N, K, rows bucket) -> the fastest plan measured in this process, or None where cuBLAS won.
_plans: dict[tuple[int, int, int], tuple[int, int, int] | None] = {}


def _bucket(rows: int) -> int:
    return 1 if rows == 1 else 4 if rows <= 4 else MAX_ROWS


def candidates(n: int, k: int) -> list[tuple[int, int, int]]:
    return [
        (bn, bk, split)
        for bn, bk, split in _CANDIDATES
        if k // split >= bk and (split == 1 or -(-n // bn) <= _MAX_SPLIT_TILES)
    ]


def _graph_time(fn, calls: int = 20) -> float:
    """Seconds per call, replayed from a CUDA graph: eager timing would measure launch cost."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * calls * 1000)


class SkinnyLinear:
    """One weight's product for at most ``MAX_ROWS`` rows. The first call of each row bucket times
    the candidate plans and cuBLAS (outside any graph capture) and keeps the fastest."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.contiguous()
        self.bias = bias
        n = self.weight.shape[0]
        self.partials = torch.empty(1, device=weight.device)
        self.counts = torch.zeros(-(-n // 16), dtype=torch.int32, device=weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        plan = self.plan(rows.shape[0])
        if plan is None:
            out = F.linear(rows, self.weight, self.bias)
        else:
            out = self.launch(rows, plan)
        return out.view(*x.shape[:-1], out.shape[-1])

    def plan(self, rows: int) -> tuple[int, int, int] | None:
        n, k = self.weight.shape
        key = (n, k, _bucket(rows))
        if key not in _plans:
            if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: a safe default
                return (32, 128, 1)
            _plans[key] = self._tune(key[2])
        plan = _plans[key]
        if plan is not None:
            self._reserve(plan)
        return plan

    def _tune(self, rows: int) -> tuple[int, int, int] | None:
        x = torch.randn(rows, self.weight.shape[1], device=self.weight.device, dtype=self.weight.dtype)
        best, best_time = None, _graph_time(lambda: F.linear(x, self.weight, self.bias))
        for plan in candidates(*self.weight.shape):
            self._reserve(plan)
            seconds = _graph_time(lambda plan=plan: self.launch(x, plan))
            if seconds < best_time:
                best, best_time = plan, seconds
        return best

    def _reserve(self, plan: tuple[int, int, int]) -> None:
        need = plan[2] * MAX_ROWS * self.weight.shape[0] if plan[2] > 1 else 1
        if self.partials.numel() < need:
            self.partials = torch.empty(need, device=self.weight.device)

    def launch(self, rows: torch.Tensor, plan: tuple[int, int, int]) -> torch.Tensor:
        m, k = rows.shape
        n = self.weight.shape[0]
        block_n, block_k, split = plan
        y = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
        _skinny_kernel[(-(-n // block_n), split)](
            rows,
            self.weight,
            self.bias if self.bias is not None else self.weight,
            y,
            self.partials,
            self.counts,
            m,
            n,
            k,
            rows.stride(0),
            self.weight.stride(0),
            y.stride(0),
            HAS_BIAS=self.bias is not None,
            BLOCK_M=MAX_ROWS,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=split,
            num_warps=4,
            num_stages=3,
        )
        return y


def usable(weight: torch.Tensor) -> bool:
    return (
        available()
        and weight.is_cuda
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.shape[1] % 16 == 0
    )
