"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral. Attention is the llama family's; the MLP of
sparse layers is a router that picks ``num_experts_per_tok`` experts per token and a weighted sum
of those experts' gated MLPs.

Qwen2-MoE adds a shared expert that every token goes through, scaled by a sigmoid gate.

Routing (all three): softmax over all experts in float32, top-k, then (Mixtral always,
Qwen3-MoE when ``norm_topk_prob``) divide by the sum of the k selected probabilities.

Experts run grouped: tokens sorted by expert, one matmul pair per expert that has tokens (the
torch path, on the CPU and the oracle), or one Triton grouped-matmul launch over all experts on
CUDA (no host synchronisation, so decode steps stay capturable in CUDA graphs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from trtedge.runtime.artifacts.quantize import QuantizedTensor
from trtedge.runtime.models.layers import ACTIVATIONS, GatedMLP, require, rms_norm
from trtedge.runtime.models.llama import LlamaModel
from trtedge.runtime.ops import triton_attention, triton_gemv
from trtedge.runtime.ops.linear import make_linear

# Per family: where the sparse block lives, its router, and each expert's (gate, up, down) names.
_NAMES = {
    "qwen2_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_omni_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),  # its thinker
    "mixtral": ("block_sparse_moe.", "gate", ("w1", "w3", "w2")),
    "qwen3_5_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),
    "gemma4_text": ("", "router.proj", ("gate_proj", "up_proj", "down_proj")),  # fused experts only
}


def expert_names(cfg) -> tuple[str, list[tuple[str, str, str]]]:
    """Names inside a layer (without ".weight"): the router, and (gate, up, down) of each expert."""
    block, router, (gate, up, down) = _NAMES[cfg.model_type]
    experts = [f"{block}experts.{e}." for e in range(cfg.num_experts)]
    return block + router, [(p + gate, p + up, p + down) for p in experts]


def fused_experts(cfg, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The experts as transformers 5 keeps them, if the checkpoint has that form: ``experts.gate_up_proj``
    [E, 2I, H] (each expert's gate rows, then its up rows; not transposed) and ``experts.down_proj``
    [E, H, I] (with or without a ``.weight`` suffix). None when the experts come one by one."""
    prefix = _NAMES[cfg.model_type][0] + "experts."

    def find(name: str) -> str | None:
        return next((n for n in (prefix + name, prefix + name + ".weight") if n in w), None)

    gate_up, down = find("gate_up_proj"), find("down_proj")
    if gate_up is None and down is None:
        return None
    if gate_up is None or down is None:
        missing = prefix + ("gate_up_proj" if gate_up is None else "down_proj")
        raise ValueError(f"checkpoint has fused experts but no tensor {missing!r}")
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for name, shape in ((gate_up, (e, 2 * i, h)), (down, (e, h, i))):
        if tuple(w[name].shape) != shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(w[name].shape)}, expected {shape} "
                "(num_experts, rows, columns)"
            )
    return w[gate_up], w[down]


class SparseMoE:
    def __init__(self, cfg, w: dict[str, torch.Tensor], weight_format: str):
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {cfg.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        self.act = cfg.hidden_act
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        router, experts = expert_names(cfg)
        dtype = _layer_dtype(w)
        self.router = _float(require(w, router + ".weight"), torch.float32)  # routing stays precise
        self.scales = None  # fp8 experts: the (gate_up, down) row scales [E, N] of the grouped kernel
        # Stacked [E, 2I, H] and [E, H, I]: the grouped kernel's operands; per-expert linear layers are
        # views of them (or their int8 form), so a quantized build quantizes experts like any layer.
        fused = fused_experts(cfg, w)
        if fused is not None:
            self.w_gate_up, self.w_down = fused
            self.gate_up = [make_linear(t, None, weight_format) for t in self.w_gate_up]
            self.down = [make_linear(t, None, weight_format) for t in self.w_down]
        else:
            gate_up = [
                _cat(require(w, g + ".weight"), require(w, u + ".weight"), dtype) for g, u, _ in experts
            ]
            down = [require(w, d + ".weight") for _, _, d in experts]
            if _fp8_rows(gate_up + down):  # E4M3 experts, a scale per row: the grouped kernel reads them
                self.w_gate_up, self.w_down = (torch.stack([q.data for q in t]) for t in (gate_up, down))
                self.scales = tuple(
                    torch.stack([q.scale.view(-1) for q in t]).float() for t in (gate_up, down)
                )
                # the per-expert layers view the stacked weights (one copy of the experts)
                gate_up, down = (
                    [QuantizedTensor("fp8", d, sc[:, None]) for d, sc in zip(data, scales)]
                    for data, scales in zip((self.w_gate_up, self.w_down), self.scales)
                )
            else:
                gate_up, down = [_float(t, dtype) for t in gate_up], [_float(t, dtype) for t in down]
                self.w_gate_up, self.w_down = torch.stack(gate_up), torch.stack(down)
            self.gate_up = [make_linear(t, None, weight_format) for t in gate_up]
            self.down = [make_linear(t, None, weight_format) for t in down]
        self.grouped_kernel = (
            weight_format == "float" and self.w_down.is_cuda and triton_attention.available()
        )
        if not self.grouped_kernel:
            self.w_gate_up = self.w_down = None  # the per-expert layers hold the weights
        # CUDA decode: the router's product reads RMSNorm(x) itself (see fused_decode)
        # (fp8 experts: the decode kernels read 16-bit ones; the grouped kernel runs them)
        fusable = (
            self.grouped_kernel
            and self.scales is None
            and self.act == "silu"
            and triton_gemv.usable(self.router)
        )
        self.router_product = triton_gemv.SkinnyLinear(self.router, None) if fusable else None
        # TRTEDGE_MOE_DECODE=1: a few rows take the decode kernels (triton_moe.decode_experts) in the
        # unfused layer too, instead of the grouped kernel (which sorts pairs by expert)
        self.decode_kernels = fusable and os.environ.get("TRTEDGE_MOE_DECODE", "0") == "1"
        self.shared = self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared = GatedMLP.from_layer(w, cfg.hidden_act, weight_format, prefix="mlp.shared_expert.")
            self.shared_gate = _float(require(w, "mlp.shared_expert_gate.weight"), torch.float32)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in h's dtype, expert ids [T, k])."""
        probs = F.linear(h.to(self.router.dtype), self.router).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def __call__(self, h: torch.Tensor, kernels=None) -> torch.Tensor:
        from trtedge.runtime.ops import triton_moe

        if self.decode_kernels and h.shape[0] <= triton_moe.DECODE_MAX_ROWS:
            # a few rows: the router's product, then two kernels that read only the selected experts
            h = h.contiguous()
            out = torch.empty_like(h)
            triton_moe.decode_experts(
                h, None, 0.0, self.router_product(h), self.w_gate_up, self.w_down, self.top_k,
                self.normalize, out=out,
            )  # fmt: skip
        elif self.grouped_kernel:
            weights, ids = self.route(h)
            out = triton_moe.fused_experts(
                h, self.w_gate_up, self.w_down, weights, ids, ACTIVATIONS[self.act], self.scales
            )
        else:
            out = self.grouped_reference(h, *self.route(h))
        if self.shared is not None:
            out = out + torch.sigmoid(
                F.linear(h.to(self.shared_gate.dtype), self.shared_gate).to(h.dtype)
            ) * self.shared(h)
        return out

    @property
    def fuses_decode(self) -> bool:
        return self.router_product is not None and self.shared is None

    def fused_decode(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> None:
        """x += this MLP of RMSNorm(x) * norm for a decode step's rows (at most 16). Up to
        ``DECODE_MAX_ROWS`` rows: three kernels (the router's product, the selected experts' gate_up
        with SiLU-mul, their down with the weighted sum and the residual add); more rows take the
        grouped path, which reads each active expert once for all its rows."""
        from trtedge.runtime.ops import triton_moe

        if x.shape[0] <= triton_moe.DECODE_MAX_ROWS:
            logits = self.router_product.fused(x, norm=norm, eps=eps)
            triton_moe.decode_experts(
                x, norm, eps, logits, self.w_gate_up, self.w_down, self.top_k, self.normalize
            )
            return
        x.add_(self(rms_norm(x, norm, eps)))

    def grouped_reference(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sort (token, slot) pairs by expert; one gate_up/down matmul pair per expert with tokens."""
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        scale = weights.flatten()
        out = torch.zeros_like(h)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            rows = pairs // self.top_k
            gate, up = self.gate_up[e](h[rows]).chunk(2, dim=-1)
            y = self.down[e](ACTIVATIONS[self.act](gate) * up)
            out.index_add_(0, rows, y * scale[pairs, None])
        return out

    @property
    def linears(self) -> list:
        return [*self.gate_up, *self.down, *(self.shared.linears if self.shared is not None else [])]


def _cat(gate, up, dtype: torch.dtype):
    if isinstance(gate, QuantizedTensor) and isinstance(up, QuantizedTensor) and gate.format == up.format:
        return QuantizedTensor.cat([gate, up])
    return torch.cat([_float(gate, dtype), _float(up, dtype)])


def _float(t, dtype: torch.dtype):
    """A quantized weight dequantized to ``dtype`` (a router, an expert the grouped kernel cannot read)."""
    return t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t


def _fp8_rows(tensors) -> bool:
    """E4M3 weights with a scale per row, on a device whose kernels take them."""
    from trtedge.runtime.ops import quant_linear

    return all(
        isinstance(t, QuantizedTensor)
        and t.format == "fp8"
        and t.scale.numel() == t.shape[0]
        and t.device.type == "cuda"
        and quant_linear.runs(t, t.device)
        for t in tensors
    )


def _layer_dtype(w: dict) -> torch.dtype:
    """The model dtype, read from the layer's float tensors (its norms)."""
    return next(
        (t.dtype for t in w.values() if isinstance(t, torch.Tensor) and t.dtype in _FLOATS), torch.float32
    )


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class MoeModel(LlamaModel):
    """Qwen3-MoE, Qwen2-MoE and Mixtral: sparse layers get a SparseMoE; the others (mlp_only_layers,
    decoder_sparse_step) keep a dense gated MLP."""

    def _mlp_fuses(self, mlp) -> bool:
        return mlp.fuses_decode if isinstance(mlp, SparseMoE) else super()._mlp_fuses(mlp)

    def make_mlp(self, index: int, w: dict[str, torch.Tensor], weight_format: str):
        if self.cfg.sparse_layers[index]:
            return SparseMoE(self.cfg, w, weight_format)
        return GatedMLP.from_layer(w, self.cfg.hidden_act, weight_format)
