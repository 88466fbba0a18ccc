"""FP8 prefill candidates on Hopper: activations quantized per row in one pass (the row held in
registers), and a Triton E4M3 x E4M3 matrix product with a scale per activation row and per weight
row applied to the float32 sums. The oracles are ``triton_quant.fp8_rows_reference`` and
``triton_quant.w8_reference``.
"""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import triton

if triton is not None:
    import triton.language as tl

    from trtedge.runtime.ops.triton_quant_prefill import _tile

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """ROWS activation rows to E4M3, each with its own scale (largest magnitude -> 448), each
        row read once (BLOCK >= K)."""
        rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rk = tl.arange(0, BLOCK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        tl.store(s_ptr + rm, scale, mask=rm < M)
        q = tl.clamp(x / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)

    @triton.jit
    def _gemm_kernel(
        a_ptr, b_ptr, sa_ptr, sb_ptr, y_ptr, M, N, K, stride_y,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """E4M3 a [M, K] times E4M3 b [N, K] (both K-major, as the FP8 tensor cores read them),
        y = (a @ b.T) * sa[:, None] * sb[None, :]; K a multiple of BLOCK_K."""
        pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        am = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
        bn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
        a = a_ptr + am[:, None] * K + rk[None, :]
        b = b_ptr + bn[:, None] * K + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(a), tl.trans(tl.load(b)), acc)
            a += BLOCK_K
            b += BLOCK_K
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tma_gemm_kernel(
        a_desc, b_desc, sa_ptr, sb_ptr, y_desc, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    ):  # fmt: skip
        """``_gemm_kernel`` persistent (one program per SM walks the output tiles) with its operands
        and output moved by the TMA unit (tensor descriptors)."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        for tile in tl.range(
            tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
        ):
            first_m = (tile // width) * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            off_m = (first_m + (tile % width) % size_m) * BLOCK_M
            off_n = ((tile % width) // size_m) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                acc = tl.dot(a_desc.load([off_m, k0]), b_desc.load([off_n, k0]).T, acc)
            rm = off_m + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
            sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
            y_desc.store([off_m, off_n], (acc * sa[:, None] * sb[None, :]).to(y_desc.dtype))


def fp8_rows(x: torch.Tensor, rows_per_program: int = 1, warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (E4M3 [M, K], float32 scales [M, 1]), ``x ~ q * s`` per row."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _rows_kernel[(-(-m // rows_per_program),)](
        x, q, scale, m, k, x.stride(0), ROWS=rows_per_program, BLOCK=block, num_warps=warps
    )
    return q, scale


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMM_PLANS = (
    (128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3),
    (128, 256, 64, 8, 4), (64, 256, 128, 4, 4),
)  # fmt: skip


def fp8_gemm(
    xq: torch.Tensor, scale_x: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor, plan=GEMM_PLANS[0],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """E4M3 xq [M, K] (scales [M] or [M, 1]) times E4M3 w [N, K] (scales [N] or [N, 1]) -> [M, N]."""
    m, k = xq.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages = plan
    if k % bk:
        raise ValueError(f"fp8_gemm needs K to be a multiple of {bk}, got {k}")
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    _gemm_kernel[(-(-m // bm) * -(-n // bn),)](
        xq, w, scale_x, scale_w, y, m, n, k, y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, flatten, warp_specialize)
TMA_PLANS = (
    (128, 256, 128, 8, 3, True, False), (128, 128, 128, 8, 4, True, False),
    (128, 256, 128, 8, 3, False, True), (128, 128, 128, 8, 4, False, True),
)  # fmt: skip
_num_sms: dict[int, int] = {}


def fp8_gemm_tma(xq, scale_x, w, scale_w, plan=TMA_PLANS[0], out_dtype=torch.bfloat16) -> torch.Tensor:
    """``fp8_gemm`` through the persistent TMA kernel (Hopper and later)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages, flatten, specialize = plan
    device = xq.device.index or 0
    if device not in _num_sms:
        _num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    sms = _num_sms[device]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    tiles = -(-m // bm) * -(-n // bn)
    _tma_gemm_kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(xq, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        scale_x, scale_w, TensorDescriptor.from_tensor(y, [bm, bn]), m, n, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms, FLATTEN=flatten,
        WARP_SPECIALIZE=specialize, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
