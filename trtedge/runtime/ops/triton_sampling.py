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
        # murmur3's finalizer in uint32 arithmetic: products wrap at 2**32, which is what
        # sampler._fmix32 computes on int64 tensors by masking after each product
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _uniform(offs, lo, hi):
        """The (0, 1) uniform of token ids ``offs`` under the key (lo, hi), as exponential_noise."""
        h = _fmix32(_fmix32(offs.to(tl.uint32) ^ lo) ^ hi)
        return ((h >> 8).to(tl.float32) + 0.5) / 16777216.0

    @triton.jit
    def _race_kernel(probs_ptr, keys_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lo = tl.load(keys_ptr + row * 2).to(tl.uint32)
        hi = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
        best = tl.full((), -1.0, tl.float32)
        best_id = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab
            p = tl.load(probs_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
            u = _uniform(offs, lo, hi)
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

    @triton.jit
    def _row_key(rows_ptr, row, n, MIX: tl.constexpr):
        """A row's (low, high) 32-bit key halves from ``rows``' first two columns (of n): the halves
        themselves, or with MIX (seed, position), whose splitmix64 (``sampler.mix_seed``) is the key.
        uint64 products wrap modulo 2**64 as the masked Python ones do."""
        a = tl.load(rows_ptr + row)
        b = tl.load(rows_ptr + n + row)
        if MIX:
            z = a.to(tl.uint64, bitcast=True) + (b.to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            return (z & 0xFFFFFFFF).to(tl.uint32), (z >> 32).to(tl.uint32)
        return a.to(tl.uint32), b.to(tl.uint32)

    # the row count is not specialised on (1, a multiple of 16, any other): one compile serves every
    # batch, so a batch size the warm-up did not see compiles nothing inside a request
    @triton.jit(do_not_specialize=["n"])
    def _race_logits_kernel(
        logits_ptr, rows_ptr, best_ptr, best_id_ptr, n, vocab, stride,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, MIX: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, vocabulary chunk): the chunk's best Gumbel score
        # logit / T - log(noise), the log of exp(logit / T) / noise (the race over p / noise without
        # the softmax: argmax is unchanged by the softmax's shift and scale). ``rows``: [3, n] int64,
        # the key columns (see _row_key) and each temperature's float32 bits.
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        lo, hi = _row_key(rows_ptr, row, n, MIX)
        temperature = tl.load(rows_ptr + 2 * n + row).to(tl.int32).to(tl.float32, bitcast=True)
        best = tl.full((), float("-inf"), tl.float32)
        best_id = tl.full((), 0, tl.int32) + part * CHUNK
        for start in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, vocab), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab
            x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
            noise = tl.maximum(
                -tl.log(_uniform(offs, lo, hi)), 2.9802322387695312e-08
            )  # see exponential_noise
            score = tl.where(mask, x / temperature - tl.log(noise), float("-inf"))
            block_best = tl.max(score, axis=0)
            block_id = tl.argmax(score, axis=0).to(tl.int32) + start
            better = block_best > best  # the first maximum wins, as torch's argmax picks it
            best_id = tl.where(better, block_id, best_id)
            best = tl.where(better, block_best, best)
        tl.store(best_ptr + row * SPLITS + part, best)
        tl.store(best_id_ptr + row * SPLITS + part, best_id.to(tl.int64))


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


RACE_CHUNK = 8192  # vocabulary entries a program of race_logits scans (152k: 19 programs a row)


def race_logits(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race of ``race`` over ``softmax(logits / temperature)`` read straight from the logits, in one
    pass and many programs a row: argmax of ``logits / T - log(noise)``. It draws from the same
    distribution with the same noise; where two tokens' scores are within rounding of each other it
    may pick the other one than the probability path does. ``temperature``: [rows] float32, > 0;
    ``keys``: [rows, 2] int64, the keys' (low, high) halves."""
    bits = temperature.to(torch.float32).view(torch.int32).long()
    rows = torch.cat([keys[:, 0], keys[:, 1], bits])
    return _race_logits(logits, rows, mix=False)


def race_logits_seeded(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``race_logits`` with each row's key mixed on the device from its (seed, position), as
    ``sampler.mix_seed`` mixes it: ``rows`` [3 * n] int64 holds the seeds (as int64 of the same
    bits), the positions, then the temperatures' float32 bits (``sampler.race_rows``)."""
    return _race_logits(logits, rows, mix=True)


def _race_logits(logits: torch.Tensor, rows: torch.Tensor, mix: bool) -> torch.Tensor:
    n, vocab = logits.shape
    splits = -(-vocab // RACE_CHUNK)
    best = torch.empty(n, splits, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(n, splits, dtype=torch.long, device=logits.device)
    if n:
        _race_logits_kernel[(n, splits)](
            logits, rows, best, best_id, n, vocab, logits.stride(0),
            CHUNK=RACE_CHUNK, BLOCK=2048, SPLITS=splits, MIX=mix, num_warps=4,
        )  # fmt: skip
    return best_id.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]
