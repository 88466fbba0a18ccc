"""Routed experts for decode-sized batches on CUDA (Triton), where sorting (token, slot) pairs by
expert (triton_moe's grouped matmul) costs more kernels than the products themselves:

- ``sigmoid_route``: Nemotron-H's router after its product in one launch (sigmoid, the correction
  bias for the choice, top-k, renormalise and scale), for one expert group;
- ``pair_gemv``: one product per (token, slot) pair with its chosen expert's weight, the squared
  ReLU optionally applied to the input and the routing weight to the output.

The torch code in models/nemotron_h.py (``RoutedMoE.route`` and the per-expert loop) is the oracle.
Importable without Triton."""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import triton

MAX_PAIRS = 128  # above this many (token, slot) pairs the grouped matmul reads each expert once

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _sigmoid_route_kernel(
        logits_ptr,  # [T, E] float32 router logits
        bias_ptr,  # [E] float32 correction bias (the choice only)
        ids_ptr,  # [T, TOP_K] int64
        weights_ptr,  # [T, TOP_K] float32
        E,
        scaling,
        TOP_K: tl.constexpr,
        TOP_K_PAD: tl.constexpr,  # a power of two
        NORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        t = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        me = offs_e < E
        scores = tl.sigmoid(tl.load(logits_ptr + t * E + offs_e, mask=me, other=0.0))
        choice = tl.where(me, scores + tl.load(bias_ptr + offs_e, mask=me, other=0.0), float("-inf"))
        offs_j = tl.arange(0, TOP_K_PAD)
        picked_ids = tl.zeros((TOP_K_PAD,), tl.int64)
        picked = tl.zeros((TOP_K_PAD,), tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(choice, axis=0)
            pick = tl.min(tl.where(choice == best, offs_e, BLOCK_E), axis=0)  # the lowest index on ties
            score = tl.sum(tl.where(offs_e == pick, scores, 0.0), axis=0)
            picked_ids = tl.where(offs_j == j, pick.to(tl.int64), picked_ids)
            picked = tl.where(offs_j == j, score, picked)
            choice = tl.where(offs_e == pick, float("-inf"), choice)
        if NORMALIZE:
            picked = picked / (tl.sum(picked, axis=0) + 1e-20)
        tl.store(ids_ptr + t * TOP_K + offs_j, picked_ids, mask=offs_j < TOP_K)
        tl.store(weights_ptr + t * TOP_K + offs_j, picked * scaling, mask=offs_j < TOP_K)

    @triton.jit
    def _pair_gemv_kernel(
        x_ptr,  # [P / ROW_DIV, K] the input row of each pair
        w_ptr,  # [E, N, K]
        ids_ptr,  # [P] the expert of each pair
        scale_ptr,  # [P] float32 (HAS_SCALE)
        out_ptr,  # [P, N]
        N,
        K,
        ROW_DIV: tl.constexpr,
        RELU2_IN: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        p = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        expert = tl.load(ids_ptr + p).to(tl.int64)
        x_row = x_ptr + (p // ROW_DIV).to(tl.int64) * K
        w_base = w_ptr + expert * N * K
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < K
            x = tl.load(x_row + offs_k, mask=mk, other=0.0).to(tl.float32)
            if RELU2_IN:  # rounded as the unfused squared ReLU in the activations' dtype
                x = tl.maximum(x, 0.0)
                x = (x * x).to(dt).to(tl.float32)
            w = tl.load(
                w_base + offs_n[:, None] * K + offs_k[None, :],
                mask=mn[:, None] & mk[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_SCALE:  # the product rounded to the activations' dtype, then weighted in float32
            acc = acc.to(dt).to(tl.float32) * tl.load(scale_ptr + p)
        tl.store(out_ptr + p.to(tl.int64) * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mn)


def sigmoid_route(
    h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, normalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]) for one expert group (``RoutedMoE.route``):
    the router's product by cuBLAS (every SM streams the router), the rest in one launch."""
    t = h.shape[0]
    e = router.shape[0]
    logits = torch.nn.functional.linear(h.float(), router)
    ids = torch.empty(t, top_k, dtype=torch.long, device=h.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=h.device)
    _sigmoid_route_kernel[(t,)](
        logits,
        bias,
        ids,
        weights,
        e,
        scaling,
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        NORMALIZE=normalize,
        BLOCK_E=triton.next_power_of_2(e),
    )
    return weights, ids


def pair_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    row_div: int,
    scale: torch.Tensor | None = None,
    relu2_in: bool = False,
) -> torch.Tensor:
    """out[p] = w[ids[p]] @ f(x[p // row_div]) for each pair p, with f the squared ReLU where
    ``relu2_in``: [P, N] in x's dtype, or with ``scale`` that times scale[p] in float32."""
    pairs = ids.numel()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(pairs, n, dtype=x.dtype if scale is None else torch.float32, device=x.device)
    block_n = 16
    _pair_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        x.contiguous(),
        w,
        ids,
        out if scale is None else scale.contiguous(),
        out,
        n,
        k,
        ROW_DIV=row_div,
        RELU2_IN=relu2_in,
        HAS_SCALE=scale is not None,
        BLOCK_N=block_n,
        BLOCK_K=256,
    )
    return out
