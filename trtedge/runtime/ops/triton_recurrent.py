"""Triton kernels for the decode step of hybrid models' recurrent layers (CUDA), each one launch per
layer for a whole batch, reading and updating the state pool in place at the rows' state slots (so
a step captures in a CUDA graph and moves each state once, not through gather/scatter copies):

- ``conv_step``: the short causal conv1d (+ bias) + silu of one token, shifting the conv state;
- ``gated_delta_step``: Qwen3.5's gating (decay from ``a``, beta from ``b``), the l2-normalised q/k
  and the gated delta rule;
- ``ssm_step``: Mamba-2's discretised step (softplus, clamp), the selective state update and the
  D skip;
- ``gated_norm``: the gated RMSNorm both families end the mixer with.

The torch code in gated_delta.py / ssd.py and the models is their oracle. Importable without Triton.
"""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import available, triton

__all__ = ["available", "conv_step", "gated_delta_step", "gated_norm", "ssm_step"]

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _softplus(x):
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold

    @triton.jit
    def _keep_state(saves_ptr, r, save_ptr, row_size, within, s, tile):
        """Verify chains: store the state tile ``s`` (offsets ``within`` of a state row of ``row_size``)
        in the scratch row that row ``r``'s token keeps, if it keeps one (``saves[r]`` >= 0)."""
        s_row = tl.load(saves_ptr + r)
        save = save_ptr + tl.maximum(s_row, 0).to(tl.int64) * row_size + within
        tl.store(save, s, mask=tile & (s_row >= 0))

    @triton.jit
    def _conv_step_kernel(
        x_ptr,  # [B, C] this token's conv inputs (row stride x_stride)
        state_ptr,  # [rows, K - 1, C] the layer's conv states
        rows_ptr,  # [B] each row's state slot
        w_ptr,  # [C, K]
        bias_ptr,  # [C] (HAS_BIAS)
        out_ptr,  # [B, C] float32
        lens_ptr,  # CHAIN: [B] the chain's length at its first row, 0 at its other rows
        saves_ptr,  # CHAIN: [B] the scratch row that keeps the state after the row's token (-1: none)
        save_ptr,  # CHAIN: [scratch rows, K - 1, C]
        x_stride,
        C,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        CHAIN: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = offs < C
        row = tl.load(rows_ptr + b).to(tl.int64)
        base = state_ptr + row * (K - 1) * C
        n = 1
        if CHAIN:  # this program runs the chain that starts at row b, one token after the other
            n = tl.load(lens_ptr + b)
        w_last = tl.load(w_ptr + offs * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
        for t in range(n):
            r = b + t
            x = tl.load(x_ptr + r * x_stride + offs, mask=mask, other=0.0)
            acc = x.to(tl.float32) * w_last
            keep = mask
            save = base
            if CHAIN:
                s_row = tl.load(saves_ptr + r)
                keep = mask & (s_row >= 0)
                save = save_ptr + tl.maximum(s_row, 0).to(tl.int64) * (K - 1) * C
            for j in tl.static_range(K - 1):
                s = tl.load(base + j * C + offs, mask=mask, other=0.0)
                acc += s.to(tl.float32) * tl.load(w_ptr + offs * K + j, mask=mask, other=0.0).to(tl.float32)
                if j > 0:  # the window moves one token: state[j - 1] <- state[j]
                    tl.store(base + (j - 1) * C + offs, s, mask=mask)
                    if CHAIN:
                        tl.store(save + (j - 1) * C + offs, s, mask=keep)
            xs = x.to(state_ptr.dtype.element_ty)
            tl.store(base + (K - 2) * C + offs, xs, mask=mask)
            if CHAIN:
                tl.store(save + (K - 2) * C + offs, xs, mask=keep)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + r * C + offs, acc * tl.sigmoid(acc), mask=mask)
            if CHAIN:
                tl.debug_barrier()  # the next token reads the state this one wrote

    @triton.jit
    def _gated_delta_step_kernel(
        qkv_ptr,  # [B, 2 * HK * DK + HV * DV] float32: q, k, v after the conv
        a_ptr,  # [B, HV] raw decay input (row stride ab_stride)
        b_ptr,  # [B, HV] raw beta input (row stride ab_stride)
        a_exp_ptr,  # [HV] exp(A_log)
        dt_bias_ptr,  # [HV]
        state_ptr,  # [rows, HV, DK, DV] float32
        rows_ptr,  # [B]
        out_ptr,  # [B, HV, DV] float32
        lens_ptr,  # CHAIN: as _conv_step_kernel's
        saves_ptr,  # CHAIN
        save_ptr,  # CHAIN: [scratch rows, HV, DK, DV]
        ab_stride,
        scale,
        HV,
        KEY_DIM,  # HK * DK
        REP: tl.constexpr,  # value heads per key head
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        CHAIN: tl.constexpr,
    ):
        b = tl.program_id(0)
        hv = tl.program_id(1)
        hk = hv // REP
        row_len = 2 * KEY_DIM + HV * DV
        offs_k = tl.arange(0, BK)
        mk = offs_k < DK
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        mv = offs_v < DV
        tile = mk[:, None] & mv[None, :]
        n = 1
        if CHAIN:  # the chain that starts at row b, its state kept in registers from token to token
            n = tl.load(lens_ptr + b)
            tile = tile & (n > 0)
        a_exp = tl.load(a_exp_ptr + hv)
        dt_bias = tl.load(dt_bias_ptr + hv)
        row = tl.load(rows_ptr + b).to(tl.int64)
        inner = (hv * DK + offs_k[:, None]) * DV + offs_v[None, :]
        ptrs = state_ptr + row * HV * DK * DV + inner
        s = tl.load(ptrs, mask=tile, other=0.0)
        for t in range(n):
            r = b + t
            qkv = qkv_ptr + r * row_len
            q = tl.load(qkv + hk * DK + offs_k, mask=mk, other=0.0)
            k = tl.load(qkv + KEY_DIM + hk * DK + offs_k, mask=mk, other=0.0)
            v = tl.load(qkv + 2 * KEY_DIM + hv * DV + offs_v, mask=mv, other=0.0)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            a = tl.load(a_ptr + r * ab_stride + hv).to(tl.float32) + dt_bias
            g = -a_exp * _softplus(a)
            beta = tl.sigmoid(tl.load(b_ptr + r * ab_stride + hv).to(tl.float32))
            s = s * tl.exp(g)
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
            s = s + k[:, None] * delta[None, :]
            if CHAIN:
                _keep_state(saves_ptr, r, save_ptr, HV * DK * DV, inner, s, tile)
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(out_ptr + (r * HV + hv) * DV + offs_v, o, mask=mv)
        tl.store(ptrs, s, mask=tile)

    @triton.jit
    def _ssm_step_kernel(
        xbc_ptr,  # [B, H * P + 2 * G * N] float32: x, B, C after the conv
        dt_ptr,  # [B, H] raw step input (row stride dt_stride)
        dt_bias_ptr,  # [H]
        a_ptr,  # [H] (negative)
        d_ptr,  # [H]
        state_ptr,  # [rows, H, P, N] float32
        rows_ptr,  # [B]
        out_ptr,  # [B, H, P] float32
        lens_ptr,  # CHAIN: as _conv_step_kernel's
        saves_ptr,  # CHAIN
        save_ptr,  # CHAIN: [scratch rows, H, P, N]
        dt_stride,
        dt_min,
        H,
        G,
        REP: tl.constexpr,  # heads per group
        P: tl.constexpr,
        N: tl.constexpr,
        BP: tl.constexpr,
        BN: tl.constexpr,
        CHAIN: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        grp = h // REP
        inner = H * P
        offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
        mp = offs_p < P
        offs_n = tl.arange(0, BN)
        mn = offs_n < N
        tile = mp[:, None] & mn[None, :]
        n = 1
        if CHAIN:  # the chain that starts at row b, its state kept in registers from token to token
            n = tl.load(lens_ptr + b)
            tile = tile & (n > 0)
        dt_bias, a, d = tl.load(dt_bias_ptr + h), tl.load(a_ptr + h), tl.load(d_ptr + h)
        row = tl.load(rows_ptr + b).to(tl.int64)
        within = (h * P + offs_p[:, None]) * N + offs_n[None, :]
        ptrs = state_ptr + row * H * P * N + within
        s = tl.load(ptrs, mask=tile, other=0.0)
        for t in range(n):
            r = b + t
            xbc = xbc_ptr + r * (inner + 2 * G * N)
            x = tl.load(xbc + h * P + offs_p, mask=mp, other=0.0)
            bb = tl.load(xbc + inner + grp * N + offs_n, mask=mn, other=0.0)
            cc = tl.load(xbc + inner + G * N + grp * N + offs_n, mask=mn, other=0.0)
            dt = _softplus(tl.load(dt_ptr + r * dt_stride + h).to(tl.float32) + dt_bias)
            dt = tl.maximum(dt, dt_min)
            s = s * tl.exp(dt * a)
            s = s + (x * dt)[:, None] * bb[None, :]
            if CHAIN:
                _keep_state(saves_ptr, r, save_ptr, H * P * N, within, s, tile)
            y = tl.sum(s * cc[None, :], axis=1) + d * x
            tl.store(out_ptr + (r * H + h) * P + offs_p, y, mask=mp)
        tl.store(ptrs, s, mask=tile)

    @triton.jit
    def _gated_norm_kernel(
        y_ptr,  # [T, NG * D] float32
        z_ptr,  # [T, NG * D] the gate (row stride z_stride)
        w_ptr,  # the norm weight: [D] shared by the groups (w_group_stride 0) or [NG * D]
        out_ptr,  # [T, NG * D]
        z_stride,
        w_group_stride,
        eps,
        D,
        GATE_FIRST: tl.constexpr,  # Mamba-2: norm(y * silu(z)) * w; Qwen3.5: norm(y) * w * silu(z)
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        grp = tl.program_id(1)
        ng = tl.num_programs(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        y = tl.load(y_ptr + (t * ng + grp) * D + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + t * z_stride + grp * D + offs, mask=mask, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if GATE_FIRST:
            y = y * gate
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) / D + eps)
        y = y * tl.load(w_ptr + grp * w_group_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if not GATE_FIRST:
            y = y * gate
        tl.store(out_ptr + (t * ng + grp) * D + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_stride(x: torch.Tensor) -> int:
    if x.stride(-1) != 1:
        raise ValueError("internal error: a recurrent kernel's input needs unit stride along its last dim")
    return x.stride(0)


def conv_step(
    x: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias=None, chain=None
) -> torch.Tensor:
    """One token of each row: ``x`` [B, C], ``states`` [slots, K-1, C] (updated in place at ``rows``),
    ``weight`` [C, K] -> silu(conv + bias) [B, C] in float32 (``gated_delta.causal_conv_step``).
    ``chain``: ``Chains`` of the rows (consecutive rows of one sequence, its state at ``rows``)."""
    b, c = x.shape
    k = weight.shape[1]
    out = torch.empty(b, c, dtype=torch.float32, device=x.device)
    block = 128
    lens, saves, save = (chain.lens, chain.saves, chain.conv) if chain is not None else (rows, rows, states)
    _conv_step_kernel[(b, triton.cdiv(c, block))](
        x,
        states,
        rows,
        weight,
        weight if bias is None else bias,
        out,
        lens,
        saves,
        save,
        _rows_stride(x),
        c,
        K=k,
        HAS_BIAS=bias is not None,
        CHAIN=chain is not None,
        BLOCK_C=block,
    )
    return out


def gated_delta_step(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_exp: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    rows: torch.Tensor,
    num_k_heads: int,
    chain=None,
) -> torch.Tensor:
    """Qwen3.5's recurrent step for B rows: ``qkv`` [B, 2*HK*DK + HV*DV] float32 (after the conv),
    ``a``/``b`` [B, HV] raw, ``states`` [slots, HV, DK, DV] (updated in place at ``rows``) ->
    the outputs [B, HV, DV] float32. ``chain``: as ``conv_step``'s."""
    nb = qkv.shape[0]
    hv, dk, dv = states.shape[1:]
    if a.stride() != b.stride():
        raise ValueError("internal error: a and b must be views of one projection")
    out = torch.empty(nb, hv, dv, dtype=torch.float32, device=qkv.device)
    bv = min(32, triton.next_power_of_2(dv))
    lens, saves, save = (chain.lens, chain.saves, chain.ssm) if chain is not None else (rows, rows, states)
    _gated_delta_step_kernel[(nb, hv, triton.cdiv(dv, bv))](
        qkv,
        a,
        b,
        a_exp,
        dt_bias,
        states,
        rows,
        out,
        lens,
        saves,
        save,
        _rows_stride(a),
        dk**-0.5,
        hv,
        num_k_heads * dk,
        REP=hv // num_k_heads,
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        CHAIN=chain is not None,
    )
    return out


def ssm_step(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    dt_min: float,
    states: torch.Tensor,
    rows: torch.Tensor,
    num_groups: int,
    chain=None,
) -> torch.Tensor:
    """Mamba-2's step for B rows: ``xbc`` [B, H*P + 2*G*N] float32 (after the conv), ``dt`` [B, H] raw,
    ``states`` [slots, H, P, N] (updated in place at ``rows``) -> y + D * x [B, H, P] float32.
    ``chain``: as ``conv_step``'s."""
    nb = xbc.shape[0]
    h, p, n = states.shape[1:]
    out = torch.empty(nb, h, p, dtype=torch.float32, device=xbc.device)
    bp = min(16, triton.next_power_of_2(p))
    lens, saves, save = (chain.lens, chain.saves, chain.ssm) if chain is not None else (rows, rows, states)
    _ssm_step_kernel[(nb, h, triton.cdiv(p, bp))](
        xbc,
        dt,
        dt_bias,
        a,
        d,
        states,
        rows,
        out,
        lens,
        saves,
        save,
        _rows_stride(dt),
        dt_min,
        h,
        num_groups,
        REP=h // num_groups,
        P=p,
        N=n,
        BP=bp,
        BN=triton.next_power_of_2(n),
        CHAIN=chain is not None,
    )
    return out


def gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, groups: int, gate_first: bool, dtype
) -> torch.Tensor:
    """RMSNorm over each of ``groups`` equal slices of ``y`` [T, W] (float32), gated by silu(``z``)
    [T, W] before it (``gate_first``, Mamba-2) or after it (Qwen3.5); ``weight`` is [W] or, shared by
    the groups, [W / groups]. Returns [T, W] in ``dtype``."""
    t, width = y.shape
    d = width // groups
    out = torch.empty(t, width, dtype=dtype, device=y.device)
    _gated_norm_kernel[(t, groups)](
        y,
        z,
        weight,
        out,
        _rows_stride(z),
        d if weight.numel() == width else 0,
        eps,
        d,
        GATE_FIRST=gate_first,
        BLOCK=triton.next_power_of_2(d),
    )
    return out
