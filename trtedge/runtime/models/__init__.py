"""Model families, by HF ``model_type``; a plain dict, one file per family."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from trtedge.runtime.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError
from trtedge.runtime.models.gemma3 import Gemma3Model
from trtedge.runtime.models.gemma3n import Gemma3nModel
from trtedge.runtime.models.gemma4 import Gemma4Model, PleModel
from trtedge.runtime.models.llama import LlamaModel
from trtedge.runtime.models.moe import MoeModel, expert_names
from trtedge.runtime.models.nemotron_asr import NemotronASRModel
from trtedge.runtime.models.nemotron_h import NemotronHModel, nemotron_h_dummy_tensors
from trtedge.runtime.models.ple import find_ple_tensor
from trtedge.runtime.models.protocol import CausalLM
from trtedge.runtime.models.qwen2_5_omni import Qwen25OmniModel
from trtedge.runtime.models.qwen2_5_vl import Qwen25VLModel
from trtedge.runtime.models.qwen3_5 import Qwen35Model, hybrid_dummy_tensors
from trtedge.runtime.models.qwen3_asr import Qwen3ASRModel, Qwen3OmniModel
from trtedge.runtime.models.qwen3_vl import Qwen3VLModel
from trtedge.runtime.multimodal import is_encoder_tensor

log = logging.getLogger("trtedge")

ARCHITECTURES = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "phi3": LlamaModel,
    "qwen2_moe": MoeModel,
    "qwen3_moe": MoeModel,
    "mixtral": MoeModel,
    "gemma3_text": Gemma3Model,
    "gemma3n_text": Gemma3nModel,
    "gemma4_text": Gemma4Model,
    "qwen3_5": Qwen35Model,
    "qwen3_5_moe": Qwen35Model,
    "qwen3_next": Qwen35Model,
    "qwen2_5_vl": Qwen25VLModel,
    "qwen3_vl": Qwen3VLModel,
    "qwen3_asr": Qwen3ASRModel,
    "qwen2_5_omni": Qwen25OmniModel,
    "qwen3_omni_moe": Qwen3OmniModel,
    "nemotron_h": NemotronHModel,
    "nemotron3_5_asr": NemotronASRModel,
    "nemotron_asr_streaming": NemotronASRModel,
}
# Families whose layers take QuantizedTensor weights; others get them dequantized.
_QUANTIZED_ARCHITECTURES = {
    LlamaModel,
    Gemma3Model,
    Qwen25VLModel,
    Qwen3VLModel,
    Qwen3ASRModel,
    Qwen25OmniModel,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device (--device) is cuda but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # bf16/fp16 matmuls are slower than fp32 on most CPUs
    return torch.float16 if cfg.torch_dtype == "float16" else torch.bfloat16


def native_quantized(device: torch.device, dtype: torch.dtype) -> bool:
    """True where int8 / int4 weights run as they are: the CPU in float32 with the native kernels."""
    from trtedge.runtime.ops.linear import int8_available

    return device.type == "cpu" and dtype == torch.float32 and int8_available()


def runnable_formats(device: torch.device, dtype: torch.dtype) -> frozenset[str]:
    """The quantized formats whose layers run as they are on ``device``: int8 / int4 through the
    native CPU kernels (float32), int8 / int4 / fp8 through the Triton kernels on CUDA."""
    from trtedge.runtime.ops import quant_linear

    if native_quantized(device, dtype):
        return frozenset(("int8", "int4", "gguf"))
    if quant_linear.usable(device, dtype):
        return frozenset(("int8", "int4", "fp8"))
    return frozenset()


def gguf_fallback(tensor, runnable: frozenset[str], runs):
    """A "gguf" tensor where its kernels do not run but int4 / int8 ones do: int4 for Q4_K rows,
    int8 otherwise, as bundles held them before the blocks were kept (else the tensor itself)."""
    from trtedge.runtime.artifacts.quantize import GGUF_BLOCKS, quantize

    q4_k = GGUF_BLOCKS["Q4_K"][0]
    fmt = "int4" if all(t == q4_k for t in tensor.scale[:, 1].tolist()) else "int8"
    if fmt not in runnable:
        return tensor
    converted = quantize(tensor.dequantize(), fmt)
    return converted if runs(converted) else tensor


def prepare_tensors(tensors, checkpoint, weights: str, runnable: frozenset[str], dtype: torch.dtype, device):
    """Bring each tensor to the format it runs in: quantized tensors (a bundle's, a pre-quantized
    checkpoint's) stay quantized where their format runs (else they are dequantized); float ones are
    quantized as ``weights`` asks (a checkpoint loaded without a bundle, random weights)."""
    from trtedge.runtime.artifacts.quantize import QuantizedTensor, quantize, target_format
    from trtedge.runtime.ops import quant_linear

    sources = checkpoint.quantization or {}
    dequantized: dict[str, int] = {}
    requantized = 0

    def runs(q: QuantizedTensor) -> bool:
        return q.format in runnable and (device.type != "cuda" or quant_linear.runs(q, device))

    for name, tensor in tensors:
        if not isinstance(tensor, QuantizedTensor):
            if (fmt := target_format(name, tensor.shape, weights, sources.get(name))) in runnable:
                tensor = quantize(tensor.to(device), fmt)
        if isinstance(tensor, QuantizedTensor) and tensor.format == "gguf" and not runs(tensor):
            converted = gguf_fallback(tensor, runnable, runs)
            tensor, requantized = converted, requantized + (converted is not tensor)
        if isinstance(tensor, QuantizedTensor) and tensor.format == "fp8" and not runs(tensor):
            as_int8 = quantize(tensor.dequantize(), "int8")  # no fp8 kernel here (the CPU, pre-Ada GPUs)
            if runs(as_int8):
                tensor, requantized = as_int8, requantized + 1
        if isinstance(tensor, QuantizedTensor):
            keep = runs(tensor)
            if not keep:
                dequantized[tensor.format] = dequantized.get(tensor.format, 0) + 1
            tensor = tensor.to(device) if keep else tensor.dequantize(dtype)
        yield name, tensor
    if requantized:
        log.warning(
            "%d fp8 / GGUF-block tensors requantized to int8 / int4 at load (no kernel for them on %s; "
            "build with --weights int8 or int4 to store them so)",
            requantized,
            device,
        )
    if dequantized:
        counts = ", ".join(f"{n} {fmt}" for fmt, n in sorted(dequantized.items()))
        log.warning("%s tensors run dequantized to %s on %s (no kernel for them here)", counts, dtype, device)


def dummy_tensors(cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    """Random weights (std 0.02, norms 1, seed 0) in HF names, made on the device: for benchmarking shapes."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim

    # seeded: the same weights in every process (an engine core process, a peer in the same benchmark)
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, generator=generator) * 0.02

    if cfg.linear is not None:
        zeros = lambda n: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
        yield from hybrid_dummy_tensors(cfg, rand, zeros, _mlp_shapes)
        return
    if cfg.model_type == "nemotron_h":
        yield from nemotron_h_dummy_tensors(cfg, rand, lambda n: torch.ones(n, dtype=dtype, device=device))
        return

    yield "model.embed_tokens.weight", rand(cfg.vocab_size, h)
    yield "model.norm.weight", torch.ones(h, dtype=dtype, device=device)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", rand(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            **_mlp_shapes(cfg, i),
        }
        for name, shape in shapes.items():
            yield p + name + ".weight", rand(*shape)
        if cfg.qkv_bias:
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                yield p + f"self_attn.{name}_proj.bias", rand(n)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.model_type == "gemma3_text":
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for name in norms:
            yield p + name + ".weight", torch.ones(h, dtype=dtype, device=device)
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                yield p + f"self_attn.{name}.weight", torch.ones(cfg.head_dim, dtype=dtype, device=device)


def _mlp_shapes(cfg: ModelConfig, index: int) -> dict[str, tuple[int, int]]:
    h = cfg.hidden_size
    if not cfg.sparse_layers[index]:
        n = cfg.intermediate_size
        return {"mlp.gate_proj": (n, h), "mlp.up_proj": (n, h), "mlp.down_proj": (h, n)}
    n = cfg.moe_intermediate_size
    router, experts = expert_names(cfg)
    shapes = {router: (cfg.num_experts, h)}
    for gate, up, down in experts:
        shapes.update({gate: (n, h), up: (n, h), down: (h, n)})
    if n := cfg.shared_expert_intermediate_size:
        p = "mlp.shared_expert."
        shapes.update({p + "gate_proj": (n, h), p + "up_proj": (n, h), p + "down_proj": (h, n)})
        shapes["mlp.shared_expert_gate"] = (1, h)
    return shapes


def load_model(
    checkpoint,
    *,
    dtype: str,
    device: str,
    weights: str,
    max_positions: int,
    load_format: str = "auto",
    ple=None,
    split=None,
) -> CausalLM:
    """``ple``: a PleRuntimeConfig, where a model with per-layer embeddings keeps their table.
    ``split``: ``(config, tensors) -> (config, tensors)`` applied to the tensors in the format they
    run in (a tensor-parallel rank takes its slices of the quantized weights)."""
    cfg = checkpoint.model_config
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, cfg, dev)
    cls = ARCHITECTURES[cfg.model_type]
    kernels = native_quantized(dev, torch_dtype)
    if weights == "fp8" and dev.type != "cuda":
        raise ValueError(
            "weights (--weights) fp8 runs on a CUDA GPU only; on the CPU use --weights int8 or int4 "
            "(a pre-quantized FP8 checkpoint loads there with --weights auto, dequantized)"
        )
    # Families (and partial-rotary layouts, which permute the fused qkv rows) that take no quantized
    # tensors get them dequantized, and quantize float weights to int8 themselves at load (CPU).
    aware = takes_quantized(cfg)
    runnable = runnable_formats(dev, torch_dtype) if aware else frozenset()
    if cls is MoeModel and dev.type == "cuda" and cfg.rotary_dim == cfg.head_dim:
        # the grouped expert kernel reads E4M3 rows; int4 / int8 experts are dequantized on a GPU
        runnable = runnable_formats(dev, torch_dtype) & {"fp8"}
    if cls is NemotronHModel and dev.type == "cuda" and checkpoint.scheme is not None:
        # a pre-quantized checkpoint's fp8 projections (FP8, NVFP4 read as fp8) run the fp8 kernels;
        # the model dequantizes its experts (the float grouped kernel) and routers
        runnable = runnable_formats(dev, torch_dtype) & {"fp8"}
    if dev.type == "cuda" and weights not in ("int8", "int4", "fp8") and checkpoint.scheme is None:
        runnable = frozenset()  # a GGUF's int4 / int8 on a GPU: dequantized unless --weights asks for them
    own_format = "int8" if kernels and not aware and _quantizes(weights, checkpoint) else "float"
    if weights in ("int8", "int4", "fp8") and weights not in runnable and own_format == "float":
        log.warning(
            "weights %s run dequantized to %s here (%s)",
            weights,
            torch_dtype,
            "the int kernels are CPU float32 only"
            if dev.type == "cpu"
            else f"{cfg.model_type} layers take float weights",
        )
    if load_format == "dummy" and issubclass(cls, PleModel):
        raise ValueError(
            f"load_format (--load-format) dummy: {cfg.model_type} (per-layer embeddings, KV sharing) has no "
            "random-weight layout yet; load its checkpoint"
        )
    skip: set[str] = set()
    if issubclass(cls, PleModel) and ple is not None and ple.residency == "cached" and ple.file_path is None:
        # a cached table is read from its file by rows, never loaded whole
        found = find_ple_tensor(checkpoint.weight_files())
        if found is not None:
            ple, skip = replace(ple, file_path=str(found[0])), {found[1]}
    tensors = (
        dummy_tensors(cfg, torch_dtype, dev) if load_format == "dummy" else checkpoint.iter_tensors(skip)
    )
    multimodal = cfg.vision is not None or cfg.audio is not None
    if multimodal and not getattr(checkpoint, "has_vision", True):  # a text-only bundle
        tensors = ((name, t) for name, t in tensors if not is_encoder_tensor(name))
    tensors = prepare_tensors(tensors, checkpoint, weights, runnable, torch_dtype, dev)
    extra = {"ple": ple} if issubclass(cls, PleModel) else {}
    model_cfg = cfg
    if split is not None:
        model_cfg, tensors = split(cfg, tensors)
    model = cls(model_cfg, tensors, torch_dtype, dev, own_format, max_positions, **extra)
    weight_format = (
        "+".join(sorted({type(m).__name__.removesuffix("Linear").lower() for m in _linears(model)}))
        or "float"
    )
    log.info(
        "loaded %s (%s, %d layers) on %s as %s, %s weights (%.0f MiB)",
        checkpoint.name,
        cfg.model_type,
        cfg.num_layers,
        dev,
        str(torch_dtype).removeprefix("torch."),
        weight_format,
        model.weight_bytes / 2**20,
    )
    return model


def takes_quantized(cfg: ModelConfig) -> bool:
    """Whether the family's layers run quantized tensors as they come (others dequantize them, or
    quantize float weights themselves)."""
    return ARCHITECTURES[cfg.model_type] in _QUANTIZED_ARCHITECTURES and cfg.rotary_dim == cfg.head_dim


def _quantizes(weights: str, checkpoint) -> bool:
    if weights in ("int8", "int4"):
        return True
    sources = (checkpoint.quantization or {}).values()
    return weights == "auto" and any(str(t).startswith(("Q", "IQ")) for t in sources)


def _linears(model) -> list:
    head = getattr(model, "lm_head", None)
    return ([head] if head is not None else []) + [m for layer in model.layers for m in layer.linears]


__all__ = ["ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "ModelConfig", "UnsupportedModelError", "load_model"]
