"""The random-weight GGUF files of benchmarks/cpu_scale.py: the geometry and tensor types asked for,
finite weights of a realistic size, and a model trtedge loads and decodes from."""

import gguf
import pytest
import torch

from benchmarks.cpu_scale import FORMATS, Geometry, decode_bytes, write_gguf
from trtedge.runtime.artifacts.gguf import iter_gguf_tensors, read_gguf

TINY = Geometry("tiny", "qwen2", 256, 512, 2, 4, 2, 1000, True, True, 10000.0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_written_file_has_the_geometry_types_and_sane_weights(tmp_path, fmt):
    path = tmp_path / f"tiny-{fmt}.gguf"
    write_gguf(path, TINY, fmt)
    config = read_gguf(path).config
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (256, 512, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        4,
        2,
        1000,
    )
    assert config["attention_bias"] and config["tie_word_embeddings"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    kinds = FORMATS[fmt]
    assert (
        types["blk.0.attn_q.weight"] == kinds["linear"] and types["blk.1.ffn_down.weight"] == kinds["v_down"]
    )
    assert types["token_embd.weight"] == kinds["embed"] and types["blk.0.attn_q.bias"] == "F32"
    for name, tensor in iter_gguf_tensors(path):
        assert torch.isfinite(tensor).all(), name
        if tensor.dim() == 2:
            assert 0.002 < tensor.float().std().item() < 0.2, name
    assert 0 < decode_bytes(path) < path.stat().st_size


def test_trtedge_decodes_from_a_written_file(tmp_path):
    from trtedge import LLM, SamplingParams

    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY, "q4_0")
    with LLM(str(path), cache_dir=str(tmp_path / "cache"), max_kv_cache_capacity=256) as llm:
        out = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ids = out.outputs[0].token_ids
    assert len(ids) == 6 and all(0 <= i < 1000 for i in ids)


def test_the_trtedge_child_reports_its_kv_cache_and_memory(tmp_path):
    from benchmarks.cpu_scale import KV_POSITIONS, start_trtedge

    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY, "q4_0")
    child = start_trtedge(path, tmp_path / "cache", 1, 64, "auto", "int8")
    try:
        hello = child.hello
        out = child.ask([5, 6, 7, 8], 3)
        peak = child.peak_rss()
    finally:
        child.close()
    per_token = 2 * 2 * 2 * (64 + 4)  # layers x (k, v) x kv heads x an int8 row of head_dim 64
    assert hello["kv_bytes"] == KV_POSITIONS * per_token
    assert 0 < hello["rss_loaded"] <= peak and out["decode"] > 0
