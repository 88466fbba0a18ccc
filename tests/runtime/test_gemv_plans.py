"""The decode products' candidate tilings (``triton_gemv.candidates``): which plans the start-up
timing may choose for a weight. Plain Python, so it runs without Triton or a GPU; the kernels
themselves are checked on CUDA in tests/gpu."""

from __future__ import annotations

from trtedge.runtime.ops.triton_gemv import PLAIN, Fusion, Tiling, candidates


def test_a_tiling_given_as_three_numbers_takes_the_default_warps_and_stages():
    plan = Tiling(*(32, 128, 4))
    assert (plan.num_warps, plan.num_stages, plan.vector, plan.unroll) == (4, 3, False, False)
    assert Tiling(*plan) == plan


def test_only_one_row_may_take_the_vector_kernel():
    one = candidates(6144, 4096, PLAIN, rows=1)
    assert any(plan.vector for plan in one)
    assert all(plan.num_warps in (2, 4, 8) for plan in one)
    for rows in (0, 4, 16):
        assert not any(plan.vector for plan in candidates(6144, 4096, PLAIN, rows=rows))
    # a product with folded-in work runs the tensor-core kernel, at one row too
    for fusion in (Fusion(norm=True), Fusion(silu=True, residual=True), Fusion(silu_out=True)):
        assert not any(plan.vector for plan in candidates(6144, 4096, fusion, rows=1))


def test_every_candidate_fits_its_weight():
    for n, k in ((6144, 4096), (1024, 3072), (151936, 1024), (200, 96), (4096, 12288)):
        for rows in (1, 4):
            for plan in candidates(n, k, PLAIN, rows=rows):
                assert k // plan.split >= plan.block_k, (n, k, plan)
                if plan.split > 1:  # wide weights have programs enough without split-K
                    assert -(-n // plan.block_n) <= 512, (n, k, plan)
    # too narrow for every tiling: cuBLAS alone for a plain product, the smallest tile for a fused one
    assert candidates(64, 16) == []
    assert candidates(64, 16, Fusion(norm=True)) == [Tiling(32, 32, 1)]


def test_the_qkv_epilogue_takes_one_head_per_column_tile():
    plans = candidates(6144, 4096, Fusion(rope=(32, 8, 128)), rows=1)
    assert plans and {plan.block_n for plan in plans} == {128}
    assert not any(plan.vector for plan in plans)
