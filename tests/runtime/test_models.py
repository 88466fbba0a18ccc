"""The llama-family model against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import FAMILIES, make_tiny_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.models import load_model
from trtedge.runtime.ops.attention import AttentionBatch

transformers = pytest.importorskip("transformers")


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    kv = torch.zeros(
        cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype
    )
    batch = AttentionBatch(
        slot_mapping=torch.arange(len(ids)),
        query_lens=[len(ids)],
        context_lens=[len(ids)],
        block_tables=[torch.arange(num_blocks)],
        block_size=block_size,
    )
    hidden = model.forward(
        torch.tensor(ids),
        torch.arange(len(ids)),
        [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)],
        batch,
    )
    return model.logits(hidden)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def test_logits_match_transformers(tiny):
    family, path, hf = tiny
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    model = load_model(
        resolve_checkpoint(str(path)), dtype="float32", device="cpu", weights="float", max_positions=256
    )
    ours = prefill_logits(model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{family}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-4


def test_greedy_64_tokens_match_transformers(tiny):
    family, path, hf = tiny
    ids = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=0)[
            0, len(ids) :
        ].tolist()
    with LLM(str(path), dtype="float32", device="cpu", max_kv_cache_capacity=256, max_input_len=128) as llm:
        out = llm.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    assert out.prompt_tokens == 24 and out.completion_tokens == 64


def test_smollm2_greedy_matches_transformers(tmp_path):
    from tests.tiny import export_gguf_as_hf
    from trtedge.runtime.artifacts.embedded import embedded_model_path

    try:
        gguf_path = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    path = export_gguf_as_hf(gguf_path, tmp_path / "smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with LLM(
        str(path),
        dtype="float32",
        device="cpu",
        weights="float",
        max_kv_cache_capacity=256,
        max_input_len=128,
    ) as llm:
        ids = llm.encode_prompt([{"role": "user", "content": "Tell me about the ocean."}])
        with torch.no_grad():
            ref_logits = hf(torch.tensor([ids])).logits[0]
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        ours = prefill_logits(llm.model, ids)
        out = llm.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    diff = (ours - ref_logits).abs().max().item()
    print(f"SmolLM2: max |logit difference| = {diff:.2e}")
    assert diff < 1e-3
    assert out.token_ids == ref[0, len(ids) :].tolist()
