"""The fp8 KV cache layout (E4M3 values and a float32 scale per head of each token) and its torch
reference, which run on any device; --kv-cache-dtype fp8 itself is refused off CUDA."""

from __future__ import annotations

import pytest
import torch

from trtedge.config import ConfigError, LaunchConfig
from trtedge.runtime.ops import kv_fp8
from trtedge.runtime.ops.attention import AttentionBatch, TorchAttention


def test_rows_round_trip_within_one_e4m3_step_whatever_their_magnitude():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 900.0])[None, :, None]
    x[0, 0] = 0  # an all-zero row stays zero
    rows = kv_fp8.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, 68)
    back = kv_fp8.dequantize(rows)
    assert back[0, 0].abs().max() == 0
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 16).all()
    assert kv_fp8.head_dim(rows) == 64 and kv_fp8.cache_shape((2, 16, 3, 64), "fp8") == (2, 16, 3, 68)


def test_reference_attention_over_an_fp8_cache_matches_the_float_one():
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size = 4, 2, 32, 8
    tables = [torch.tensor([3, 0, 5]), torch.tensor([1, 4])]
    query_lens, context_lens = [20, 1], [20, 9]
    slots = [int(t[p // block_size]) * block_size + p % block_size for t, q, c in zip(tables, query_lens, context_lens)
             for p in range(c - q, c)]  # fmt: skip
    batch = AttentionBatch(torch.tensor(slots), query_lens, context_lens, tables, block_size)
    total = sum(query_lens)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen) * 3
    v = torch.randn(total, kv_heads, dim, generator=gen)
    float_cache = [torch.randn(6, block_size, kv_heads, dim, generator=gen) for _ in range(2)]
    fp8_cache = [kv_fp8.quantize(c) for c in float_cache]
    attention = TorchAttention(dim**-0.5)
    ref = attention(q, k, v, *float_cache, batch)
    out = attention(q, k, v, *fp8_cache, batch)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel  # E4M3 rounding, nothing worse
    written = kv_fp8.dequantize(fp8_cache[0].view(-1, kv_heads, dim + 4)[batch.slot_mapping])
    assert ((written - k).abs() <= k.abs().amax(-1, keepdim=True) / 16).all()


def test_kv_cache_dtype_is_validated_and_refused_on_the_cpu(tmp_path):
    from trtedge import LLM

    with pytest.raises(ConfigError, match=r"--kv-cache-dtype"):
        LaunchConfig(kv_cache_dtype="int4")
    # refused before anything loads: no model is read
    with pytest.raises(ConfigError, match=r"kv_cache_dtype \(--kv-cache-dtype\) fp8 needs a CUDA GPU"):
        LLM(str(tmp_path / "no-model"), device="cpu", kv_cache_dtype="fp8", cache_dir=str(tmp_path / "cache"))


def test_an_fp8_pool_gives_the_same_tokens_whole_chunked_or_from_a_reused_prefix(tmp_path):
    """The engine path over an fp8 pool (the torch reference attention, here on the CPU): every step
    reads the cache's E4M3 rows, so a prompt prefilled whole, in chunks, or over a reused prefix
    continues the same way."""
    from tests.tiny import make_tiny_checkpoint
    from trtedge import LLM, SamplingParams
    from trtedge.runtime.engine import Engine, EngineConfig

    tiny = make_tiny_checkpoint(tmp_path / "tiny", "qwen3")
    prompt = list(range(10, 58))  # 48 tokens: three blocks
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tiny), device="cpu", max_kv_cache_capacity=256, cache_dir=str(tmp_path / "cache"),
             engine_process=False) as llm:  # fmt: skip
        model = llm.model
        model.decode_kernels = model.native_step = None  # the CPU's native kernels read float32 caches

        def run(kv="fp8", **options):
            config = EngineConfig(kv_cache_dtype=kv, max_kv_cache_capacity=256, **options)
            engine = Engine(model, llm.tokenizer, config)
            try:
                outs = [[t for d in engine.submit(prompt, params) for t in d.token_ids] for _ in range(2)]
                return outs, engine.runner.kv, engine.context_cache_metrics()["reused_tokens"]
            finally:
                engine.shutdown()

        (whole, pool, _), (chunked, _, _) = run(), run(max_num_batched_tokens=16)
        reused, _, reused_tokens = run(enable_context_reuse=True)
        (plain, _, _) = run("auto")
    assert pool.dtype == torch.uint8 and pool.shape[-1] == model.cfg.head_dim + kv_fp8.SCALE_BYTES
    assert reused_tokens >= 32  # the second request read the first two full blocks of the first's
    assert len(whole[0]) == 8
    assert whole[0] == whole[1] == chunked[0] == reused[0] == reused[1]
    assert whole[0][:4] == plain[0][:4]  # E4M3 keys and values: the float cache's answer, for a while
