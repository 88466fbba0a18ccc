"""One Triton pass for the sampling race of ``executor.sampler``: per row, the token that maximises
``p / noise`` where ``noise`` is the counter-based Exp(1) draw of (key, token id). The torch
reference (``sampler.exponential_noise``) builds the whole [rows, vocab] noise tensor through a
dozen int64 kernels; here each block of the vocabulary is hashed in registers while the
probabilities are read once."""

from __future__ import annotations

import torch

from trtedge.runtime.ops.triton_attention import triton

BLOCK = 4096

if triton is not None:
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older Triton
        libdevice = None

    @triton.jit
    def _fmix32(h):
        # murmur3's finalizer on 32-bit values held in int64 (masked after each product), exactly as
        # sampler._fmix32 computes it on int64 tensors
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _race_kernel(probs_ptr, keys_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lo = tl.load(keys_ptr + row * 2)
        hi = tl.load(keys_ptr + row * 2 + 1)
        best = tl.full((), -1.0, tl.float32)
        best_id = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab
            p = tl.load(probs_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
            h = _fmix32(_fmix32(offs.to(tl.int64) ^ lo) ^ hi)
            u = ((h >> 8).to(tl.float32) + 0.5) / 16777216.0
            if PRECISE:
                noise = -libdevice.log(u)
                noise = tl.maximum(noise, 2.9802322387695312e-08)  # 2**-25, see exponential_noise
                score = libdevice.div_rn(p, noise)
            else:
                noise = tl.maximum(-tl.log(u), 2.9802322387695312e-08)
                score = p / noise
            score = tl.where(mask, score, -1.0)
            block_best = tl.max(score, axis=0)
            block_id = tl.argmax(score, axis=0).to(tl.int32) + start
            better = block_best > best  # strictly: the first maximum wins, as torch's argmax picks it
            best_id = tl.where(better, block_id, best_id)
            best = tl.where(better, block_best, best)
        tl.store(out_ptr + row, best_id.to(tl.int64))


def supported(probs: torch.Tensor) -> bool:
    return triton is not None and probs.is_cuda and probs.dim() == 2 and probs.stride(1) == 1


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary of ``probs / exponential_noise(keys)``: one token id per row.
    ``keys``: [rows, 2] int64 holding each row's key as (low 32 bits, high 32 bits)."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.long, device=probs.device)
    if rows:
        _race_kernel[(rows,)](
            probs, keys, out, vocab, probs.stride(0), BLOCK=BLOCK, PRECISE=libdevice is not None, num_warps=8
        )
    return out
