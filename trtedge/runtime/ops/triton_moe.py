"""Grouped expert matmuls for mixture-of-experts layers on CUDA (Triton). The per-expert torch loop
in models/moe.py is their oracle.

(token, slot) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M, so
every block of BLOCK_M sorted rows belongs to one expert; one launch multiplies all blocks by their
expert's weights. Shapes depend only on the number of tokens, and nothing is read back to the
host, so decode steps stay capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _grouped_matmul_kernel(
        x_ptr,  # [rows / ROW_DIV, K]: the activations of each source row
        w_ptr,  # [E, N, K]
        out_ptr,  # [rows, N]
        sorted_rows_ptr,  # [num_blocks * BLOCK_M]: row ids by expert, `num_rows` for padding
        block_expert_ptr,  # [num_blocks]: the expert of each block, -1 past the last
        scale_ptr,  # [rows]: multiplies each output row (HAS_SCALE)
        num_rows,
        N,
        K,
        ROW_DIV: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= 0:
            rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            valid = rows < num_rows
            src = tl.where(valid, rows // ROW_DIV, 0).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w_base = w_ptr + expert.to(tl.int64) * N * K
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(
                    x_ptr + src[:, None] * K + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K),
                    other=0.0,
                )
                b = tl.load(
                    w_base + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
                    other=0.0,
                )
                if IEEE:
                    acc += tl.dot(a, b, input_precision="ieee")
                else:
                    acc += tl.dot(a, b)
            if HAS_SCALE:
                acc = acc * tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
            tl.store(
                out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=valid[:, None] & (offs_n[None, :] < N),
            )


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted row ids padded per expert to block_m, expert of each block or -1), from ids [T, k]."""
    flat = ids.flatten()
    n = flat.numel()
    num_blocks = -(-n // block_m) + num_experts  # enough for any assignment
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[experts]
    sorted_rows = torch.full((num_blocks * block_m,), n, dtype=torch.long, device=ids.device)
    sorted_rows[(padded_end - padded)[experts] + rank] = order
    starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_rows, block_expert


def grouped_matmul(x, w, sorted_rows, block_expert, num_rows: int, row_div: int, block_m: int, scale=None):
    """out[r] = w[expert(r)] @ x[r // row_div] (* scale[r]) for every row r: [num_rows, N]."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 32
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        x.contiguous(),
        w,
        out,
        sorted_rows,
        block_expert,
        out if scale is None else scale.contiguous(),
        num_rows,
        n,
        k,
        ROW_DIV=row_div,
        HAS_SCALE=scale is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fused_experts(h, w_gate_up, w_down, weights, ids, act) -> torch.Tensor:
    """sum over the k selected experts of weight * down(act(gate(h)) * up(h)): [T, H]."""
    t, top_k = ids.shape
    rows = t * top_k
    block_m = 16 if rows <= 256 else 64
    sorted_rows, block_expert = align_by_expert(ids, w_gate_up.shape[0], block_m)
    gate_up = grouped_matmul(h, w_gate_up, sorted_rows, block_expert, rows, top_k, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    y = grouped_matmul(act(gate) * up, w_down, sorted_rows, block_expert, rows, 1, block_m, weights.flatten())
    return y.view(t, top_k, -1).sum(dim=1)
