"""The small decoders of speech output: pre-norm attention (optional per-head q/k norms, GQA, rotary,
optional sliding window) with a contiguous per-sequence KV cache, the gated MLP and the Talker's routed
experts with a gated shared expert. Batch of one sequence: rows are positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import ACTIVATIONS, require, rms_norm, rotate
from trtedge.runtime.speech.config import DecoderConfig


def sub(w: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}


class KVCache:
    """Keys and values per layer, (kv heads, positions, head dim), in buffers that double when full
    (a long answer's thousands of frames copy each key a few times, not once per step)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.n = [0] * num_layers

    @property
    def length(self) -> int:
        return self.n[0]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.n[layer], self.n[layer] + k.shape[1]
        buf = self.k[layer]
        if buf is None or end > buf.shape[1]:
            size = max(end, 2 * (0 if buf is None else buf.shape[1]), 64)
            grown = [t.new_empty(t.shape[0], size, t.shape[2]) for t in (k, v)]
            if buf is not None:
                grown[0][:, :start], grown[1][:, :start] = buf[:, :start], self.v[layer][:, :start]
            self.k[layer], self.v[layer] = grown
        self.k[layer][:, start:end], self.v[layer][:, start:end] = k, v
        self.n[layer] = end
        return self.k[layer][:, :end], self.v[layer][:, :end]


class Rotary:
    def __init__(self, head_dim: int, theta: float, device):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _linear(w: dict, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    return require(w, name + ".weight"), w.get(name + ".bias")


class Attention:
    def __init__(self, cfg: DecoderConfig, w: dict, qk_norm: bool):
        self.cfg = cfg
        self.q, self.k, self.v, self.o = (_linear(w, f"self_attn.{n}_proj") for n in "qkvo")
        self.q_norm = w.get("self_attn.q_norm.weight") if qk_norm else None
        self.k_norm = w.get("self_attn.k_norm.weight") if qk_norm else None

    def __call__(self, x, cos, sin, cache: KVCache | None, layer: int) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        q = F.linear(x, *self.q).view(n, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, *self.k).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, *self.v).view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, cfg.rms_norm_eps), rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # (heads, positions, dim)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        total = k.shape[1]
        rows = torch.arange(total - n, total, device=x.device)[:, None]
        cols = torch.arange(total, device=x.device)[None, :]
        mask = cols <= rows
        if cfg.sliding_window is not None:
            mask &= cols > rows - cfg.sliding_window
        groups = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
        return F.linear(out.transpose(0, 1).reshape(n, -1), *self.o)


class MLP:
    def __init__(self, w: dict, act: str):
        self.gate, self.up, self.down = (require(w, f"{n}_proj.weight") for n in ("gate", "up", "down"))
        self.act = ACTIVATIONS[act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)


class SharedExpertMoE:
    """Softmax router, top-k experts (weights renormalised when ``norm_topk_prob``), plus a shared
    expert scaled by sigmoid(shared_expert_gate(x)). Experts one by one (``experts.{e}.gate_proj`` ...) or as
    transformers 5 holds them: gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]."""

    def __init__(self, cfg: DecoderConfig, w: dict):
        self.cfg = cfg
        self.router = require(w, "gate.weight")
        if "experts.gate_up_proj" in w:
            self.gate_up, self.down = w["experts.gate_up_proj"], require(w, "experts.down_proj")
        else:  # one expert at a time, as checkpoints on disk hold them
            e = range(cfg.num_experts)
            self.gate_up = torch.stack(
                [torch.cat([require(w, f"experts.{i}.{n}_proj.weight") for n in ("gate", "up")]) for i in e]
            )
            self.down = torch.stack([require(w, f"experts.{i}.down_proj.weight") for i in e])
        self.shared = MLP(sub(w, "shared_expert."), cfg.hidden_act)
        self.shared_gate = require(w, "shared_expert_gate.weight")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router), -1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.cfg.num_experts_per_tok, -1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        shared = torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        if experts.numel() <= 16:  # a decode step: the chosen experts' weights gathered, no host sync
            rows = experts.flatten()
            xs = x.repeat_interleave(experts.shape[1], 0)[:, :, None]  # (tokens * k, hidden, 1)
            gate, up = torch.bmm(self.gate_up[rows], xs).squeeze(-1).chunk(2, -1)
            y = torch.bmm(self.down[rows], (self.act(gate) * up)[:, :, None]).squeeze(-1)
            y = (y * weights.flatten()[:, None]).view(*experts.shape, -1).sum(1)
            return y + shared
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, -1)
            y = F.linear(self.act(gate) * up, self.down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out + shared


class Decoder:
    """Pre-norm decoder layers and a final RMS norm; ``moe``: the Talker's experts instead of the MLP;
    ``layer_scale``: Code2Wav's per-channel scales on both residual branches."""

    def __init__(
        self, cfg: DecoderConfig, w: dict, device, *, qk_norm: bool, moe: bool = False, layer_scale=False
    ):
        self.cfg = cfg
        self.layers = []
        for i in range(cfg.num_layers):
            lw = sub(w, f"layers.{i}.")
            mlp = SharedExpertMoE(cfg, sub(lw, "mlp.")) if moe else MLP(sub(lw, "mlp."), cfg.hidden_act)
            scales = (
                (require(lw, "self_attn_layer_scale.scale"), require(lw, "mlp_layer_scale.scale"))
                if layer_scale
                else None
            )
            norms = (require(lw, "input_layernorm.weight"), require(lw, "post_attention_layernorm.weight"))
            self.layers.append((Attention(cfg, lw, qk_norm), mlp, norms, scales))
        self.norm = require(w, "norm.weight")
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, device)

    def __call__(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """(positions, hidden) embeddings after what ``cache`` holds -> the final-norm hidden states."""
        eps = self.cfg.rms_norm_eps
        start = 0 if cache is None else cache.length
        cos, sin = self.rotary(torch.arange(start, start + x.shape[0], device=x.device), x.dtype)
        for i, (attn, mlp, (n1, n2), scales) in enumerate(self.layers):
            h = attn(rms_norm(x, n1, eps), cos, sin, cache, i)
            x = x + (h if scales is None else scales[0] * h)
            h = mlp(rms_norm(x, n2, eps))
            x = x + (h if scales is None else scales[1] * h)
        return rms_norm(x, self.norm, eps)
