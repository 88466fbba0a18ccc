"""Triton product for skinny activations (decode: at most 16 rows) with bf16/fp16 weights.

At batch 1 cuBLAS picks small-tile kernels that read a 0.6B model's weights at about a quarter of
the H200's bandwidth. Here each program streams one ``BLOCK_N x K/SPLIT_K`` slab of the weight
once; with split-K the last program of a column tile (found through an atomic counter, which it
resets for the next call or graph replay) sums the fp32 partials, adds the bias and stores.
``F.linear`` is the oracle."""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import available, triton

MAX_ROWS = 16
_TARGET_PROGRAMS = 264  # ~2 per SM on an H200; fewer programs leave bandwidth unused

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


def plan(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) for an N x K weight: enough programs to keep every SM reading."""
    block_n, block_k = (32, 256) if n >= 2048 else (16, 256)
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < _TARGET_PROGRAMS and k // (split * 2) >= block_k and split < 16:
        split *= 2
    return block_n, block_k, split


class SkinnyLinear:
    """Holds the split-K scratch of one weight; call with at most ``MAX_ROWS`` rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.contiguous()
        self.bias = bias
        n, k = self.weight.shape
        self.block_n, self.block_k, self.split = plan(n, k)
        tiles = -(-n // self.block_n)
        device = weight.device
        self.partials = torch.empty(self.split * MAX_ROWS * n if self.split > 1 else 1, device=device)
        self.counts = torch.zeros(tiles, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m, k = rows.shape
        n = self.weight.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        grid = (self.counts.numel(), self.split)
        _skinny_kernel[grid](
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
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            SPLIT_K=self.split,
            num_warps=4,
            num_stages=3,
        )
        return y.view(*x.shape[:-1], n)


def usable(weight: torch.Tensor) -> bool:
    return (
        available()
        and weight.is_cuda
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.shape[1] % 16 == 0
    )
