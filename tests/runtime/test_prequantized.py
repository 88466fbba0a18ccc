"""Pre-quantized checkpoints (FP8, AWQ, GPTQ, NVFP4), written here in each format's layout from a tiny
float model: recognised from their quantization config, their layers read back equal to the float
weights they stand for, recorded in the bundle, served with the float model's greedy tokens on the
CPU; schemes trtedge cannot serve are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.prequantized_tiny import FORMATS, write_dequantized, write_prequantized
from tests.tiny import make_tiny_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.runtime.artifacts.bundle import BuildProfile, cache_key, fingerprint, prepare_bundle
from trtedge.runtime.artifacts.checkpoint import CheckpointError, resolve_checkpoint
from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.models import load_model
from trtedge.runtime.ops import cpu_kernels
from trtedge.runtime.ops.linear import Int4Linear, Int8Linear

FAMILY = {"awq": "qwen3", "modelopt-nvfp4": "qwen3"}  # the others: llama
STORED = {"awq": "int4", "gptq": "int4", "gptq-act-order": "int4", "compressed-tensors-w4a16": "int4"}


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {f: make_tiny_checkpoint(root / f, f) for f in ("llama", "qwen3")}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def prequantized(request, floats, tmp_path_factory):
    fmt = request.param
    src = floats[FAMILY.get(fmt, "llama")]
    root = tmp_path_factory.mktemp(fmt)
    path, reference = write_prequantized(src, root / "q", fmt)
    return fmt, path, reference, src


def test_layers_read_back_as_the_float_weights_they_stand_for(prequantized):
    fmt, path, reference, _ = prequantized
    checkpoint = resolve_checkpoint(str(path))
    assert checkpoint.scheme is not None
    tensors = dict(checkpoint.iter_tensors())
    leftovers = ("input_scale", "qweight", "weight_scale", "g_idx", "weight_packed", "weight_shape")
    assert not any(n.endswith(leftovers) for n in tensors)
    for name, ref in reference.items():
        q = tensors[name]
        assert isinstance(q, QuantizedTensor) and q.format == STORED.get(fmt, "fp8"), name
        got = q.dequantize()
        if fmt == "gptq-act-order":  # groups out of order: requantized to int4, within one step
            step = (ref.abs().amax(dim=1, keepdim=True) * 2 / 15).expand_as(ref)
            assert ((got - ref).abs() <= step).all(), name
        elif fmt in STORED:  # int4: exact but for -zero * scale rounded to float16
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * ref.abs().max().item())
        else:  # fp8 scales carried over: exact
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the native CPU kernels")
@pytest.mark.parametrize(
    "fmt", ["compressed-tensors-fp8-channel", "compressed-tensors-w4a16", "awq", "gptq", "modelopt-nvfp4"]
)
def test_served_on_the_cpu_with_the_float_models_greedy_tokens(fmt, floats, tmp_path):
    src = floats[FAMILY.get(fmt, "llama")]
    path, reference = write_prequantized(src, tmp_path / "q", fmt)
    float_path = write_dequantized(src, tmp_path / "float", reference)
    ids = torch.randint(3, 500, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = []
    for model in (float_path, path):
        with LLM(str(model), dtype="float32", device="cpu", max_kv_cache_capacity=128, max_input_len=64,
                 cache_dir=tmp_path / "cache") as llm:  # fmt: skip
            outputs.append(llm.generate(ids, params).token_ids)
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "awq"])
def test_the_bundle_records_the_scheme_and_keeps_its_format(fmt, floats, tmp_path):
    path, _ = write_prequantized(floats[FAMILY.get(fmt, "llama")], tmp_path / "q", fmt)
    bundle = prepare_bundle(str(path), BuildProfile(), cache_dir=tmp_path / "cache")
    try:
        section = bundle.manifest["components"]["llm"]
        assert section["prequantized"]["method"] == ("fp8" if fmt == "modelopt-fp8" else "awq")
        assert not section["weights"]["externalized"]
        stored = STORED.get(fmt, "fp8")
        assert section["weights"]["quantization"]["tensors"][stored] == 14  # 7 linears x 2 layers
        tensors = dict(bundle.iter_tensors())
        assert tensors["model.layers.0.mlp.down_proj.weight"].format == stored
        model = load_model(bundle, dtype="float32", device="cpu", weights="auto", max_positions=64)
        if cpu_kernels.load() is not None:  # fp8 has no CPU kernel: requantized to int8 per row
            expected = Int4Linear if stored == "int4" else Int8Linear
            assert isinstance(model.layers[0].qkv, expected) and isinstance(
                model.layers[1].mlp.down, expected
            )
    finally:
        bundle.release()


def test_the_cache_key_changes_with_the_quantization_config(floats, tmp_path):
    src = floats["llama"]
    a, _ = write_prequantized(src, tmp_path / "a", "modelopt-fp8")
    b, _ = write_prequantized(src, tmp_path / "b", "modelopt-fp8")
    config = json.loads((b / "hf_quant_config.json").read_text())
    config["quantization"]["exclude_modules"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    (b / "hf_quant_config.json").write_text(json.dumps(config))
    keys = {cache_key(fingerprint(p)[0], None, BuildProfile()) for p in (src, a, b)}
    assert len(keys) == 3


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits 8"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
        ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "ModelOpt quant_algo 'W4A8_AWQ'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "compressed-tensors format 'marlin-24' with weights int4",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False}}},
            },
            "pack-quantized with asymmetric int4 weights",
        ),
    ],
)
def test_a_scheme_trtedge_cannot_serve_is_refused_by_name(floats, tmp_path, config, named):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(floats["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    with pytest.raises(CheckpointError, match="not supported") as err:
        resolve_checkpoint(str(path))
    assert named in str(err.value)


def test_fp8_requested_on_the_cpu_is_refused_naming_the_flag(floats):
    with pytest.raises(ValueError, match=r"--weights\) fp8 runs on a CUDA GPU only"):
        load_model(resolve_checkpoint(str(floats["llama"])), dtype="float32", device="cpu", weights="fp8",
                   max_positions=64)  # fmt: skip


def test_an_incomplete_quantized_layer_is_refused(floats, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = write_prequantized(floats["llama"], tmp_path / "q", "awq")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj' is incomplete: no scales"):
        list(resolve_checkpoint(str(path)).iter_tensors())


@pytest.mark.parametrize(
    ("config", "method", "stored"),
    [
        (
            {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16}},
            "nvfp4",
            "fp8",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"},
            "gptq",
            "int4",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", "fp8"),
    ],
)
def test_schemes_are_read_from_the_quantization_config(config, method, stored):
    from trtedge.runtime.artifacts.prequantized import detect

    scheme = detect({"quantization_config": config})
    assert scheme.method == method and scheme.stored_format == stored
    assert detect({"model_type": "llama"}) is None
    if method == "gptq":
        assert scheme.zero_offset == 0 and scheme.group_size == -1


def test_tensor_parallel_refuses_a_prequantized_checkpoint(floats, tmp_path):
    from trtedge.config import ConfigError

    path, _ = write_prequantized(floats["llama"], tmp_path / "q", "gptq")
    with pytest.raises(
        ConfigError, match=r"--tensor-parallel-size\) > 1 splits float weights.*pre-quantized"
    ):
        LLM(str(path), cache_dir=str(tmp_path / "cache"), tensor_parallel_size=2, device="cpu")
