"""MoE checkpoints whose experts are stored fused, as transformers 5 keeps them in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), load like the
per-expert form and give the same tokens."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint
from trtedge import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

_EXPERT = re.compile(r"(.+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


def fuse_experts(src, dst):
    """Copy checkpoint ``src`` to ``dst`` with each layer's experts stacked into the two fused tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, parts in groups.items():
        experts = sorted(parts["gate"])
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]]) for e in experts]
        )
        out[prefix + "down_proj"] = torch.stack([parts["down"][e] for e in experts])
    assert groups
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_fused_experts_load_and_match_the_per_expert_checkpoint(family, tmp_path):
    if family == "qwen3_moe":
        per_expert = make_tiny_checkpoint(tmp_path / "split", family)
    else:
        per_expert = make_tiny_hybrid_checkpoint(tmp_path / "split", vision=False, moe=True)
    fused = fuse_experts(per_expert, tmp_path / "fused")
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(1))
    logits = []
    for path in (per_expert, fused):  # HF reads the fused layout natively: the rewrite is its layout
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(hf(ids).logits)
    torch.testing.assert_close(logits[0], logits[1])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = []
    for path in (per_expert, fused):
        with LLM(str(path), dtype="float32", max_kv_cache_capacity=128) as llm:
            outs.append(llm.generate(ids[0].tolist(), params).token_ids)
    assert len(outs[0]) == 24 and outs[0] == outs[1]


def test_fused_experts_with_a_wrong_shape_name_the_tensor(tmp_path):
    per_expert = make_tiny_checkpoint(tmp_path / "split", "qwen3_moe")
    fused = fuse_experts(per_expert, tmp_path / "fused")
    tensors = load_file(str(fused / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="mlp.experts.gate_up_proj' has shape"):
        LLM(str(fused), dtype="float32", max_kv_cache_capacity=128)
