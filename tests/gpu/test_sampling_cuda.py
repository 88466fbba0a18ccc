"""The one-pass Triton sampling race against its torch reference (sampler.exponential_noise), and the
engine's seeded sampling on CUDA with it. Skips cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("vocab", [1000, 4096, 151936])
def test_triton_race_picks_the_reference_token_on_every_row(vocab):
    from trtedge.runtime.executor.sampler import exponential_noise, mix_seed, split_keys
    from trtedge.runtime.ops import triton_sampling

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=gen) * 3
    probs = torch.softmax(logits, dim=-1)
    probs[::3, vocab // 2 :] = 0.0  # rows cut by top-k / top-p
    probs = probs.cuda()
    keys = [mix_seed(1234 + r, 17 * r) for r in range(64)]
    reference = (probs / exponential_noise(keys, vocab, probs.device)).argmax(dim=-1)
    fused = triton_sampling.race(probs, torch.tensor(split_keys(keys), device="cuda"))
    assert fused.tolist() == reference.tolist()
    assert len(set(fused.tolist())) > 32  # the draws differ from row to row


def test_the_race_draws_from_the_distribution():
    from trtedge.runtime.executor.sampler import mix_seed, split_keys
    from trtedge.runtime.ops import triton_sampling

    p = torch.tensor([0.5, 0.3, 0.2, 0.0], device="cuda").repeat(20000, 1)
    keys = torch.tensor(split_keys([mix_seed(7, i) for i in range(20000)]), device="cuda")
    counts = torch.bincount(triton_sampling.race(p, keys), minlength=4).tolist()
    assert counts[3] == 0
    for got, want in zip(counts[:3], (0.5, 0.3, 0.2)):
        assert abs(got / 20000 - want) < 0.02


@pytest.mark.parametrize("vocab", [1000, 8193, 151936])
def test_the_race_over_logits_picks_the_probability_paths_token(vocab):
    """race_logits (logits / T - log(noise), many programs a row) against the reference race over
    softmax(logits / T) / noise with the same keys: the same token but where two scores tie within
    rounding."""
    from trtedge.runtime.executor.sampler import exponential_noise, mix_seed, split_keys
    from trtedge.runtime.ops import triton_sampling

    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab, generator=gen) * 3).cuda()
    temperature = torch.rand(64, generator=gen).cuda() * 1.5 + 0.1
    keys = [mix_seed(99 + r, 5 * r) for r in range(64)]
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    reference = (probs / exponential_noise(keys, vocab, probs.device)).argmax(dim=-1)
    drawn = triton_sampling.race_logits(logits, temperature, torch.tensor(split_keys(keys), device="cuda"))
    assert sum(a == b for a, b in zip(drawn.tolist(), reference.tolist())) >= 62
    assert len(set(drawn.tolist())) > 32


def test_the_seeded_race_mixes_the_keys_on_the_device_as_the_host_does():
    """race_logits_seeded (splitmix64 of (seed, position) in the kernel) picks what race_logits picks
    with the keys mix_seed made on the host: seeds past 2**63, negative and wider than 64 bits too."""
    import random

    from trtedge.runtime.executor.sampler import mix_seed, race_rows, split_keys, upload
    from trtedge.runtime.ops import triton_sampling

    rng = random.Random(0)
    seeds = [rng.randrange(2**64) for _ in range(200)] + [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -5, 2**70 + 3]
    positions = [rng.randrange(-10, 10**7) for _ in seeds]
    temperatures = [rng.uniform(0.1, 2.0) for _ in seeds]
    logits = (torch.randn(len(seeds), 151936, generator=torch.Generator().manual_seed(1)) * 3).cuda()
    keys = torch.tensor(split_keys([mix_seed(s, p) for s, p in zip(seeds, positions)]), device="cuda")
    t = torch.tensor(temperatures, dtype=torch.float32, device="cuda")
    host = triton_sampling.race_logits(logits, t, keys)
    device = triton_sampling.race_logits_seeded(
        logits, upload(race_rows(seeds, positions, temperatures), "cuda")
    )
    assert torch.equal(host, device)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_race_over_logits_draws_from_the_tempered_distribution(temperature):
    from trtedge.runtime.executor.sampler import mix_seed, split_keys
    from trtedge.runtime.ops import triton_sampling

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = p.log().cuda().repeat(20000, 1)  # the last token is masked (-inf)
    keys = torch.tensor(split_keys([mix_seed(3, i) for i in range(20000)]), device="cuda")
    t = torch.full((20000,), temperature, device="cuda")
    counts = torch.bincount(triton_sampling.race_logits(logits, t, keys), minlength=4).tolist()
    want = p ** (1 / temperature)
    want = (want / want.sum()).tolist()
    assert counts[3] == 0
    for got, share in zip(counts[:3], want[:3]):
        assert abs(got / 20000 - share) < 0.02


def test_to_device_gives_each_dtype_and_shape_back():
    from trtedge.runtime.executor.sampler import to_device

    device = torch.device("cuda")
    assert to_device([[1, 2], [3, 4]], torch.long, device).tolist() == [[1, 2], [3, 4]]
    assert to_device([0.5, 1.5], torch.float32, device).tolist() == [0.5, 1.5]
    assert to_device([7, 8, 9], torch.int32, device).dtype == torch.int32
    assert to_device([], torch.long, device).numel() == 0
