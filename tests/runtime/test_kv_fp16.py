"""--kv-cache-dtype fp16 on the CPU: a float16 pool that the native decode kernels (the one-call
step and the per-op kernels) and the torch reference attention read and write alike."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_checkpoint
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.models import load_model
from trtedge.runtime.ops import cpu_kernels
from trtedge.runtime.ops.attention import AttentionBatch

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the native CPU kernels")


@pytest.mark.parametrize("weights", ["float", "int4"])  # float: the per-op kernels; int4: the one-call step
def test_native_decode_over_a_float16_cache_matches_the_reference(tmp_path, weights):
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    model = load_model(
        resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights=weights, max_positions=64
    )
    cfg = model.cfg
    block_size, context_lens = 4, [9, 3, 14]
    tables = [torch.tensor([5, 1, 7, 2]), torch.tensor([3]), torch.tensor([8, 9, 10, 11])]
    slots = [
        int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
        for t, c in zip(tables, context_lens)
    ]
    batch = AttentionBatch(torch.tensor(slots), [1] * 3, context_lens, tables, block_size)
    ids, pos = torch.tensor([5, 9, 30]), torch.tensor([c - 1 for c in context_lens])
    kv = torch.randn(cfg.num_layers, 2, 16, block_size, cfg.num_kv_heads, cfg.head_dim).half()
    native_kv, ref_kv = kv.clone(), kv.clone()
    native = model.forward(
        ids, pos, [(native_kv[i, 0], native_kv[i, 1]) for i in range(cfg.num_layers)], batch
    )
    saved = model.decode_kernels, model.native_step
    model.decode_kernels = model.native_step = None
    try:
        ref = model.forward(ids, pos, [(ref_kv[i, 0], ref_kv[i, 1]) for i in range(cfg.num_layers)], batch)
    finally:
        model.decode_kernels, model.native_step = saved
    assert saved[0 if weights == "float" else 1] is not None  # the native path ran
    tol = 2e-3 if weights == "int4" else 1e-4
    torch.testing.assert_close(native, ref, rtol=tol, atol=tol)
    assert native_kv.dtype == torch.float16 and not torch.equal(native_kv, kv)  # the step wrote float16 rows
    torch.testing.assert_close(native_kv.float(), ref_kv.float(), rtol=2e-3, atol=2e-3)


def test_an_fp16_pool_halves_the_kv_memory_and_continues_prompts_alike(tmp_path):
    from trtedge import LLM, SamplingParams
    from trtedge.runtime.engine import Engine, EngineConfig

    tiny = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    prompt = list(range(10, 58))  # 48 tokens: three blocks
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tiny), device="cpu", weights="int4", max_kv_cache_capacity=256, cache_dir=str(tmp_path / "c"),
             engine_process=False) as llm:  # fmt: skip
        model = llm.model
        assert model.native_step is not None

        def run(kv="fp16", **options):
            engine = Engine(
                model, llm.tokenizer, EngineConfig(kv_cache_dtype=kv, max_kv_cache_capacity=256, **options)
            )
            try:
                outs = [[t for d in engine.submit(prompt, params) for t in d.token_ids] for _ in range(2)]
                return outs, engine.runner.kv_bytes, engine.context_cache_metrics()["reused_tokens"]
            finally:
                engine.shutdown()

        (whole, half_bytes, _), (chunked, _, _) = run(), run(max_num_batched_tokens=16)
        reused, _, reused_tokens = run(enable_context_reuse=True)
        (plain, float_bytes, _) = run("auto")
    assert half_bytes * 2 == float_bytes
    assert reused_tokens >= 32
    assert len(whole[0]) == 8 and whole[0] == whole[1] == chunked[0] == reused[0] == reused[1]
    assert whole[0] == plain[0]  # float16 keys and values: the float32 cache's answer here


def test_fp16_kv_is_the_cpus(tmp_path):
    from trtedge import LLM
    from trtedge.config import ConfigError

    with pytest.raises(ConfigError, match=r"kv_cache_dtype \(--kv-cache-dtype\) fp16 needs the CPU"):
        LLM(
            str(tmp_path / "no-model"),
            device="cuda",
            kv_cache_dtype="fp16",
            cache_dir=str(tmp_path / "cache"),
        )
