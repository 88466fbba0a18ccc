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
        w_scale_ptr,  # [E, N] float32: each weight row's scale (FP8: w holds E4M3 bytes)
        num_rows,
        N,
        K,
        ROW_DIV: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        FP8: tl.constexpr,
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
                    other=0,
                )
                if FP8:
                    b = b.to(tl.float8e4nv, bitcast=True).to(a.dtype)  # exact in bf16 / fp16
                if IEEE:
                    acc += tl.dot(a, b, input_precision="ieee")
                else:
                    acc += tl.dot(a, b)
            if FP8:
                w_scale = tl.load(w_scale_ptr + expert.to(tl.int64) * N + offs_n, mask=offs_n < N, other=0.0)
                acc = acc * w_scale[None, :]
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


def grouped_matmul(
    x, w, sorted_rows, block_expert, num_rows: int, row_div: int, block_m: int, scale=None, w_scale=None
):
    """out[r] = w[expert(r)] @ x[r // row_div] (* scale[r]) for every row r: [num_rows, N]. ``w_scale``
    [E, N] float32: ``w`` is E4M3 [E, N, K], each of its rows times its scale."""
    n, k = w.shape[1], w.shape[2]
    fp8 = w_scale is not None
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 32
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        x.contiguous(),
        w.view(torch.uint8) if fp8 else w,
        out,
        sorted_rows,
        block_expert,
        out if scale is None else scale.contiguous(),
        w_scale if fp8 else out,
        num_rows,
        n,
        k,
        ROW_DIV=row_div,
        HAS_SCALE=scale is not None,
        FP8=fp8,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fused_experts(h, w_gate_up, w_down, weights, ids, act, scales=None) -> torch.Tensor:
    """sum over the k selected experts of weight * down(act(gate(h)) * up(h)): [T, H]. ``scales``: the
    (gate_up, down) row scales [E, N] of E4M3 expert weights."""
    t, top_k = ids.shape
    rows = t * top_k
    block_m = 16 if rows <= 256 else 64
    gu_scale, down_scale = scales or (None, None)
    sorted_rows, block_expert = align_by_expert(ids, w_gate_up.shape[0], block_m)
    gate_up = grouped_matmul(h, w_gate_up, sorted_rows, block_expert, rows, top_k, block_m, w_scale=gu_scale)
    gate, up = gate_up.chunk(2, dim=-1)
    y = grouped_matmul(
        act(gate) * up, w_down, sorted_rows, block_expert, rows, 1, block_m, weights.flatten(), down_scale
    )
    return y.view(t, top_k, -1).sum(dim=1)


# Decode (a few rows): the router's logits come from a product; each expert kernel program redoes the
# softmax and top-k of its row from them (128 values) instead of a routing kernel and a sort, and
# reads only its selected experts' weights.
DECODE_MAX_ROWS = 4  # more rows share experts: the grouped path reads each active expert once
_DECODE_TILES = ((16, 256), (32, 128), (32, 256), (64, 128))  # (BLOCK_N, BLOCK_K)
# The down kernel's (BLOCK_N, BLOCK_K, a program per slot too): a program per (row, column tile)
# alone gives the SMs few programs (128 at Qwen3-30B-A3B's 2,048 columns and BLOCK_N 16).
_DOWN_TILES = (
    *((bn, bk, False) for bn, bk in _DECODE_TILES), (8, 256, False), (4, 512, False),
    (16, 256, True), (32, 256, True), (64, 128, True),
)  # fmt: skip
_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # the slot-split's partials and counts
_decode_plans: dict[tuple, tuple[int, int]] = {}

if triton is not None:

    @triton.jit
    def _route_row(logits_ptr, row, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
                   K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, dt: tl.constexpr):  # fmt: skip
        """A row's top-k experts [K_PAD] and their weights (float32 of the dt-rounded weight), as
        SparseMoE.route: softmax in float32, top-k, optionally over the k's sum."""
        offs = tl.arange(0, E_PAD)
        z = tl.load(logits_ptr + row * NUM_EXPERTS + offs, mask=offs < NUM_EXPERTS, other=float("-inf"))
        z = z.to(tl.float32)
        p = tl.exp(z - tl.max(z, 0))
        p = p / tl.sum(p, 0)
        slots = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], dtype=tl.int32)
        weights = tl.zeros([K_PAD], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 0)
            pick = tl.min(tl.where(p == best, offs, E_PAD), 0)  # the lowest index of a tie
            ids = tl.where(slots == j, pick, ids)
            weights = tl.where(slots == j, best, weights)
            p = tl.where(offs == pick, -1.0, p)
        if NORMALIZE:
            weights = weights / tl.sum(weights, 0)
        return ids, weights.to(dt).to(tl.float32)

    @triton.jit
    def _experts_gate_up_kernel(
        x_ptr, norm_ptr, logits_ptr, w_ptr, act_ptr, H, INTER, eps,
        NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
        NORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
        NORM_IN: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, slot, column tile): act = silu(gate) * up of the slot's expert over
        # RMSNorm(x) * norm (NORM_IN), else over x. w: [E, 2 * INTER, H] (gate rows, then up rows).
        if PDL:  # (see ops.pdl)
            tl.extra.cuda.gdc_wait()
        pair = tl.program_id(0)
        row = pair // TOP_K
        dt = act_ptr.dtype.element_ty
        ids, _ = _route_row(logits_ptr, row, NUM_EXPERTS, E_PAD, TOP_K, K_PAD, NORMALIZE, dt)
        expert = tl.sum(tl.where(tl.arange(0, K_PAD) == pair % TOP_K, ids, 0), 0).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        inv = 1.0
        if NORM_IN:
            squares = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                xf = tl.load(x_ptr + row * H + k0 + rk, mask=k0 + rk < H, other=0.0).to(tl.float32)
                squares += xf * xf
            inv = tl.rsqrt(tl.sum(squares, 0) / H + eps)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate_rows = w_ptr + expert * 2 * INTER * H + rn[:, None].to(tl.int64) * H
        up_rows = gate_rows + INTER * H
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + rk
            xf = tl.load(x_ptr + row * H + ks, mask=ks < H, other=0.0).to(tl.float32)
            if NORM_IN:
                scale = tl.load(norm_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
                h = ((xf * inv).to(dt).to(tl.float32) * scale).to(dt).to(tl.float32)[None, :]
            else:
                h = xf[None, :]
            mask = (rn[:, None] < INTER) & (ks[None, :] < H)
            g = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            u = tl.load(up_rows + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            acc_g += tl.sum(g.to(tl.float32) * h, 1)
            acc_u += tl.sum(u.to(tl.float32) * h, 1)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        g = acc_g.to(dt).to(tl.float32)
        act = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)
        tl.store(act_ptr + pair * INTER + rn, act, mask=rn < INTER)

    @triton.jit
    def _experts_down_kernel(
        act_ptr, logits_ptr, w_ptr, x_ptr, out_ptr, part_ptr, count_ptr, H, INTER,
        NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
        NORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
        RESIDUAL: tl.constexpr, SPLIT_SLOTS: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, column tile): x += sum over the row's slots of weight * down(act)
        # (RESIDUAL), else out = that sum. w: [E, H, INTER]. Roundings as fused_experts: each slot's
        # weighted rows in dt, summed in float32, the sum in dt, then the residual add.
        # SPLIT_SLOTS: a program per (row, column tile, slot) instead (TOP_K times the programs);
        # each stores its slot's weighted rows in part_ptr [rows, TOP_K, H] and the last of a tile's
        # programs (an atomic count, which it resets) sums them in slot order.
        if PDL:
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        ids, weights = _route_row(logits_ptr, row, NUM_EXPERTS, E_PAD, TOP_K, K_PAD, NORMALIZE, dt)
        slots = tl.arange(0, K_PAD)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        if SPLIT_SLOTS:
            first = tl.program_id(2)
            slot_count = 1
        else:
            first = 0
            slot_count = TOP_K
        for j in range(first, first + slot_count):
            expert = tl.sum(tl.where(slots == j, ids, 0), 0).to(tl.int64)
            weight = tl.sum(tl.where(slots == j, weights, 0.0), 0)
            rows = w_ptr + expert * H * INTER + rn[:, None].to(tl.int64) * INTER
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                ks = k0 + rk
                a = tl.load(act_ptr + (row * TOP_K + j) * INTER + ks, mask=ks < INTER, other=0.0)
                w = tl.load(
                    rows + ks[None, :],
                    mask=(rn[:, None] < H) & (ks[None, :] < INTER),
                    other=0.0,
                    eviction_policy="evict_first",
                )
                acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)
            total += (acc * weight).to(dt).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if SPLIT_SLOTS:
            tl.store(part_ptr + (row * TOP_K + first) * H + rn, total, mask=rn < H)
            count_at = count_ptr + row * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(count_at, 1) != TOP_K - 1:
                return
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in range(TOP_K):
                total += tl.load(
                    part_ptr + (row * TOP_K + j) * H + rn, mask=rn < H, other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(count_at, 0)
        if RESIDUAL:
            at = x_ptr + row * H + rn
            residual = tl.load(at, mask=rn < H, other=0.0).to(tl.float32)
            tl.store(at, (total.to(dt).to(tl.float32) + residual).to(dt), mask=rn < H)
        else:
            tl.store(out_ptr + row * H + rn, total.to(dt), mask=rn < H)


def decode_experts(
    x, norm, eps, logits, w_gate_up, w_down, top_k: int, normalize: bool, plans=None, out=None
) -> None:
    """x += the MoE MLP of RMSNorm(x) * norm for a few decode rows, from the router's ``logits``
    [T, E] (in x's dtype): each selected expert's weights are read once per row. ``norm`` None: of
    x itself; ``out`` given: the MLP's output is stored there and x is left as it is."""
    from trtedge.runtime.ops import pdl

    t, h = x.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    (gn, gk), (dn, dk, split) = plans or _decode_plan(
        w_gate_up, w_down, t, top_k, normalize, norm is not None, out is not None
    )
    parts, counts = _split_scratch(x.device, h, top_k) if split else (x, x)
    launch_pdl = pdl.enabled()
    common = dict(
        NUM_EXPERTS=num_experts,
        E_PAD=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        NORMALIZE=normalize,
        PDL=launch_pdl,
        launch_pdl=launch_pdl,
    )
    _experts_gate_up_kernel[(t * top_k, triton.cdiv(inter, gn))](
        x, x if norm is None else norm, logits, w_gate_up, act, h, inter, eps, BLOCK_N=gn, BLOCK_K=gk,
        NORM_IN=norm is not None, **common,
    )  # fmt: skip
    _experts_down_kernel[(t, triton.cdiv(h, dn), top_k if split else 1)](
        act, logits, w_down, x, x if out is None else out, parts, counts, h, inter, BLOCK_N=dn,
        BLOCK_K=dk, RESIDUAL=out is None, SPLIT_SLOTS=split, **common,
    )  # fmt: skip


def _split_scratch(device, h: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot-split down kernel's float32 partials [DECODE_MAX_ROWS, top_k, h] and its zeroed
    counts (one per row and column tile, reset by the kernel), kept per device and shape."""
    key = (device, h, top_k)
    if key not in _scratch:
        _scratch[key] = (
            torch.empty(DECODE_MAX_ROWS * top_k * h, dtype=torch.float32, device=device),
            torch.zeros(DECODE_MAX_ROWS * h, dtype=torch.int32, device=device),
        )
    return _scratch[key]


def _decode_plan(w_gate_up, w_down, rows: int, top_k: int, normalize: bool, norm_in: bool, into: bool):
    """The fastest (BLOCK_N, BLOCK_K) of each expert kernel for this shape and form (``norm_in``: the
    gate_up kernel normalizes its input; ``into``: the down kernel stores instead of adding), timed
    once per process (outside graph capture; inside one, the first tiles)."""
    from trtedge.runtime.ops.triton_gemv import _bucket, _graph_time

    key = (tuple(w_gate_up.shape), tuple(w_down.shape), _bucket(rows), top_k, normalize, norm_in, into)
    if key in _decode_plans:
        return _decode_plans[key]
    if torch.cuda.is_current_stream_capturing():
        return _DECODE_TILES[0], _DOWN_TILES[0]
    h = w_down.shape[1]
    like = dict(device=w_down.device, dtype=w_down.dtype)
    x = torch.randn(rows, h, **like)
    norm = torch.ones(h, **like) if norm_in else None
    out = torch.empty_like(x) if into else None
    logits = torch.randn(rows, w_down.shape[0], **like)

    def timed(plans) -> float:
        return _graph_time(
            lambda: decode_experts(x, norm, 1e-6, logits, w_gate_up, w_down, top_k, normalize, plans, out)
        )

    # the gate_up kernel's tiles with the first down tiles, then the down's
    gate_up = min(_DECODE_TILES, key=lambda tiles: timed((tiles, _DOWN_TILES[0])))
    down = min(_DOWN_TILES, key=lambda tiles: timed((gate_up, tiles)))
    _decode_plans[key] = (gate_up, down)
    return gate_up, down
