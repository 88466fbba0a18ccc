"""Qwen3.5 and Qwen3.5-MoE (text): Gated DeltaNet layers (short causal conv1d + gated delta rule, one
recurrent state per sequence) interleaved with gated full-attention layers (output gate, partial
rotary, q/k norm) over the paged KV cache; the MoE variant's MLP is routed experts plus a gated shared
expert. Vision-tower and multi-token-prediction weights are skipped (the ``mtp`` speculative method
loads the latter itself: speculative/mtp.py)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from trtedge.runtime.executor.state_pool import RecurrentBatch, WindowPlan, chain_steps, copy_states
from trtedge.runtime.models.config import ModelConfig
from trtedge.runtime.models.layers import GatedMLP, require, rotate
from trtedge.runtime.models.moe import SparseMoE
from trtedge.runtime.models.rope import rope_inv_freq
from trtedge.runtime.ops import gated_delta as gd
from trtedge.runtime.ops import triton_attention, triton_gemv, triton_qk_norm, triton_recurrent
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import DenseLinear, make_linear

log = logging.getLogger("trtedge")

_LAYER = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.(.+)")
_SKIPPED = ("model.visual.", "mtp.")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise and scale in float32, then cast (Qwen3.5's rounding); ``weight`` is already 1 + w."""
    return (F.rms_norm(x.float(), weight.shape, None, eps) * weight).to(x.dtype)


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], weight_format: str, index: int):
        lin = cfg.linear
        self.index = index  # among the linear-attention layers: the state pool's layer
        self.num_k_heads, self.num_v_heads = lin.num_key_heads, lin.num_value_heads
        self.dk, self.dv = lin.key_head_dim, lin.value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.dk, self.num_v_heads * self.dv
        p = "linear_attn."
        if p + "in_proj_qkvz.weight" in w:
            w = unfuse_projections(w, self.num_k_heads, self.dk, self.num_v_heads, self.dv)
        # One product for the four input projections: qkv (conv input), z (output gate), b (beta), a (decay).
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.in_proj = make_linear(torch.cat([w[p + n + ".weight"] for n in names]), None, weight_format)
        self.splits = [2 * self.key_dim + self.value_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.conv_weight = w[p + "conv1d.weight"].squeeze(1)  # [C, K]
        self.a_log_exp = w[p + "A_log"].float().exp()
        self.dt_bias = w[p + "dt_bias"].float()
        self.norm = w[p + "norm.weight"].float()
        self.out_proj = make_linear(w[p + "out_proj.weight"], None, weight_format)
        self.eps = cfg.rms_norm_eps
        self.use_fla = gd.fla_available(self.conv_weight.device)
        # CUDA: decode steps run the fused Triton kernels (in place on the state pool), every step the
        # fused gated norm
        self.fused = self.conv_weight.is_cuda and triton_recurrent.available()

    def __call__(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        return self.out_proj(self.mix(self.in_proj(x), batch))

    def mix(self, proj: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """From the input projection [T, ...] to the output projection's input [T, value_dim]."""
        t, dtype = proj.shape[0], proj.dtype
        mixed, z, b, a = proj.split(self.splits, dim=-1)
        conv, ssm = batch.pool.conv[self.index], batch.pool.ssm[self.index]
        if batch.is_decode and self.fused:
            rows, chain = batch.rows_tensor, batch.chains(self.index)
            activated = triton_recurrent.conv_step(mixed, conv, rows, self.conv_weight, chain=chain)
            out = triton_recurrent.gated_delta_step(
                activated, a, b, self.a_log_exp, self.dt_bias, ssm, rows, self.num_k_heads, chain
            )
            self._save_checkpoints(conv, ssm, batch)
            return self._gate(out, z, dtype)
        batch.require_eager()
        beta = b.float().sigmoid()
        g = -self.a_log_exp * F.softplus(a.float() + self.dt_bias)
        if batch.is_decode:
            out = self._decode(mixed, g, beta, conv, ssm, batch)
        else:
            out = torch.empty(t, self.num_v_heads, self.dv, dtype=torch.float32, device=proj.device)
            windows = batch.windows or [0] * len(batch.rows)
            start = 0
            for row, n, ckpt, w in zip(batch.rows, batch.query_lens, batch.checkpoints, windows):
                head = n - w  # tokens before the verification window: chunked
                if head:
                    end = start + head
                    out[start:end] = self._prefill(
                        mixed[start:end],
                        g[start:end],
                        beta[start:end],
                        conv,
                        ssm,
                        row,
                        ckpt if ckpt is not None and ckpt[0] <= head else None,
                    )
                start += n
            if batch.plan is not None:
                self._windows(mixed, g, beta, conv, ssm, out, batch.plan)
        return self._gate(out, z, dtype)

    def _gate(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated RMSNorm per value head: norm(o) * w * silu(z) in float32, [T, value_dim] in ``dtype``."""
        t = out.shape[0]
        if self.fused:
            return triton_recurrent.gated_norm(
                out.view(t, -1), z, self.norm, self.eps, self.num_v_heads, False, dtype
            )
        o = F.rms_norm(out, (self.dv,), None, self.eps) * self.norm
        o = o * F.silu(z.float().view(t, self.num_v_heads, self.dv))
        return o.to(dtype).reshape(t, self.value_dim)

    def _qkv(self, mixed: torch.Tensor):
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = gd.l2_normalize(q.float().unflatten(-1, (self.num_k_heads, self.dk))) * self.dk**-0.5
        k = gd.l2_normalize(k.float().unflatten(-1, (self.num_k_heads, self.dk)))
        if rep > 1:  # each key head serves `rep` consecutive value heads
            q, k = gd.repeat_heads(q, rep), gd.repeat_heads(k, rep)
        return q, k, v.float().unflatten(-1, (self.num_v_heads, self.dv))

    def _prefill(self, mixed, g, beta, conv, ssm, row: int, ckpt: tuple[int, int] | None) -> torch.Tensor:
        n, k = mixed.shape[0], self.conv_weight.shape[1]
        activated, padded = gd.causal_conv(mixed, conv[row], self.conv_weight)
        q, kk, v = self._qkv(activated)
        rule = gd.fla_chunk if self.use_fla else gd.chunk_gated_delta
        state = ssm[row]
        if ckpt is not None and ckpt[0] < n:  # stop at the checkpoint, save it, go on
            r, dst = ckpt
            head, state = rule(q[:r], kk[:r], v[:r], g[:r], beta[:r], state)
            conv[dst] = padded[r : r + k - 1]
            ssm[dst] = state
            tail, state = rule(q[r:], kk[r:], v[r:], g[r:], beta[r:], state)
            out = torch.cat([head, tail])
        else:
            out, state = rule(q, kk, v, g, beta, state)
        conv[row] = padded[n:]
        ssm[row] = state
        if ckpt is not None and ckpt[0] == n:
            conv[ckpt[1]] = conv[row]
            ssm[ckpt[1]] = state
        return out

    def _step(self, mixed, g, beta, conv, ssm, rows: torch.Tensor) -> torch.Tensor:
        """One token for each sequence whose live state is at ``rows``: the recurrent update."""
        activated, new_conv = gd.causal_conv_step(mixed, conv.index_select(0, rows), self.conv_weight)
        conv.index_copy_(0, rows, new_conv.to(conv.dtype))
        q, k, v = self._qkv(activated)
        rule = gd.fla_recurrent if self.use_fla else gd.recurrent_gated_delta
        out, state = rule(q, k, v, g, beta, ssm.index_select(0, rows))
        ssm.index_copy_(0, rows, state)
        return out

    def _decode(self, mixed, g, beta, conv, ssm, batch: RecurrentBatch) -> torch.Tensor:
        chain = batch.chains(self.index)
        if chain is None:
            out = self._step(mixed, g, beta, conv, ssm, batch.rows_tensor)
        else:  # verify chains (the fused kernels' reference): token by token, every kept state saved
            out = mixed.new_empty(mixed.shape[0], self.num_v_heads, self.dv, dtype=torch.float32)
            for index, rows, keep, saves in chain_steps(chain, batch.rows_tensor):
                out[index] = self._step(mixed[index], g[index], beta[index], conv, ssm, rows)
                copy_states((chain.conv, chain.ssm), saves, (conv, ssm), rows[keep])
        self._save_checkpoints(conv, ssm, batch)
        return out

    @staticmethod
    def _save_checkpoints(conv, ssm, batch: RecurrentBatch) -> None:
        for i, ckpt in enumerate(batch.checkpoints):
            if ckpt is not None:
                conv[ckpt[1]] = conv[batch.rows[i]]
                ssm[ckpt[1]] = ssm[batch.rows[i]]

    def _windows(self, mixed, g, beta, conv, ssm, out, plan: WindowPlan) -> None:
        """Verification windows token by token, keeping the state after each in the plan's scratch."""
        saved_conv, saved_ssm = plan.conv[self.index], plan.ssm[self.index]
        for step in plan.steps:
            i = step.index
            out[i] = self._step(mixed[i], g[i], beta[i], conv, ssm, step.rows)
            copy_states((saved_conv, saved_ssm), step.saves, (conv, ssm), step.rows)
            if step.checkpoints is not None:
                src, dst = step.checkpoints
                copy_states((conv, ssm), dst, (conv, ssm), src)


def _products_fuse(layer: Qwen35Layer) -> bool:
    """Whether a layer's decode products can take its norms, SiLU-mul and residual adds."""
    ffn = layer.ffn
    if type(ffn) is not GatedMLP or ffn.act != "silu":
        return False
    return all(type(lin) is DenseLinear and lin.skinny is not None for lin in layer.linears)


def unfuse_projections(w: dict, nk: int, dk: int, nv: int, dv: int) -> dict:
    """Qwen3-Next groups q, k, v, z (and b, a) by key head in two fused projections; split them into
    Qwen3.5's four (value heads of one key head stay consecutive, as ``_qkv`` expects)."""
    p, rep = "linear_attn.", nv // nk
    w = dict(w)
    q, k, v, z = (
        w.pop(p + "in_proj_qkvz.weight").unflatten(0, (nk, -1)).split([dk, dk, rep * dv, rep * dv], 1)
    )
    b, a = w.pop(p + "in_proj_ba.weight").unflatten(0, (nk, -1)).split([rep, rep], 1)
    w[p + "in_proj_qkv.weight"] = torch.cat([x.flatten(0, 1) for x in (q, k, v)])
    for name, x in (("z", z), ("b", b), ("a", a)):
        w[p + f"in_proj_{name}.weight"] = x.flatten(0, 1)
    return w


class GatedAttention:
    """Full attention whose q_proj also yields a per-channel output gate; rotary on part of each head."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], weight_format: str, eps: float):
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        p = "self_attn."
        names = ("q_proj", "k_proj", "v_proj")
        bias = torch.cat([w[p + n + ".bias"] for n in names]) if cfg.qkv_bias else None
        self.qkv = make_linear(torch.cat([w[p + n + ".weight"] for n in names]), bias, weight_format)
        self.o = make_linear(w[p + "o_proj.weight"], w.get(p + "o_proj.bias"), weight_format)
        self.q_norm = 1.0 + w[p + "q_norm.weight"].float()
        self.k_norm = 1.0 + w[p + "k_norm.weight"].float()
        self.eps = eps
        backend = (
            CudaAttention
            if w[p + "o_proj.weight"].is_cuda and triton_attention.available()
            else TorchAttention
        )
        self.attention = backend(cfg.head_dim**-0.5)
        self.fused = backend is CudaAttention

    def __call__(self, x, cos, sin, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        return self.o(self.attend(self.qkv(x), cos, sin, k_cache, v_cache, batch))

    def attend(self, qkv, cos, sin, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """From the qkv projection [T, ...] to the output projection's input [T, q_size]."""
        cfg, t = self.cfg, qkv.shape[0]
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        if self.fused:  # norms and rotary in one launch
            q, k = triton_qk_norm.qk_norm_rope(
                qkv,
                cos,
                sin,
                self.q_norm,
                self.k_norm,
                self.eps,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
            )
        else:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k.view(t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, self.eps)
            rd = cos.shape[-1]
            q = torch.cat([rotate(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)
            k = torch.cat([rotate(k[..., :rd], cos, sin), k[..., rd:]], dim=-1)
        o = self.attention(q, k, v.view(t, cfg.num_kv_heads, cfg.head_dim), k_cache, v_cache, batch)
        return o.reshape(t, self.q_size) * torch.sigmoid(gate).reshape(t, self.q_size)


class Qwen35Layer:
    def __init__(self, cfg, w, weight_format: str, mixer, index: int, sparse: bool | None = None):
        """``sparse``: routed experts or a dense MLP (default: the config's choice for layer ``index``)."""
        self.mixer = mixer
        self.input_norm = 1.0 + w["input_layernorm.weight"].float()
        self.post_norm = 1.0 + w["post_attention_layernorm.weight"].float()
        # Qwen3.5-MoE: routed experts plus a sigmoid-gated shared expert (SparseMoE does both)
        if sparse is None:
            sparse = bool(cfg.num_experts and cfg.sparse_layers[index])
        self.ffn = (
            SparseMoE(cfg, w, weight_format)
            if sparse
            else GatedMLP.from_layer(w, cfg.hidden_act, weight_format)
        )
        self.eps = cfg.rms_norm_eps

    @property
    def linears(self) -> list:
        mixer = self.mixer
        mixing = [mixer.in_proj, mixer.out_proj] if isinstance(mixer, GatedDeltaNet) else [mixer.qkv, mixer.o]
        return mixing + self.ffn.linears

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(rms_norm(x, self.post_norm, self.eps))


class Qwen35Model:
    """A hybrid decoder: ``forward`` takes the paged KV caches of the full-attention layers (in order)
    and a ``RecurrentBatch`` naming each sequence's row of the recurrent-state pool."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = "float",
        max_positions: int = 8192,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        lin = cfg.linear
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
        top: dict[str, torch.Tensor] = {}
        skipped = 0
        for name, tensor in tensors:
            if name.startswith(_SKIPPED):
                skipped += 1
                continue
            keep_fp32 = name.endswith(("A_log", "dt_bias"))
            tensor = tensor.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
            m = _LAYER.fullmatch(name)
            if m:
                if int(m.group(1)) < cfg.num_layers:
                    per_layer[int(m.group(1))][m.group(2)] = tensor
            else:
                top[name.replace("model.language_model.", "model.")] = tensor
        if skipped:
            log.info(
                "qwen3_5: serving the text model; skipped %d vision / multi-token-prediction tensors", skipped
            )
        self.embed = require(top, "model.embed_tokens.weight")
        self.norm = 1.0 + require(top, "model.norm.weight").float()
        head = top.get("lm_head.weight")
        self.lm_head = make_linear(
            self.embed if head is None or cfg.tie_word_embeddings else head, None, weight_format
        )
        self.layers: list[Qwen35Layer] = []
        num_linear = 0
        for index, (kind, w) in enumerate(zip(lin.layer_types, per_layer)):
            if kind == "linear_attention":
                mixer = GatedDeltaNet(cfg, w, weight_format, num_linear)
                num_linear += 1
            else:
                mixer = GatedAttention(cfg, w, weight_format, cfg.rms_norm_eps)
            self.layers.append(Qwen35Layer(cfg, w, weight_format, mixer, index))
        self.num_linear_layers = num_linear
        self.num_kv_layers = cfg.num_layers - num_linear
        rotary_dim = cfg.rotary_dim
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32),
            rope_inv_freq(cfg.rope, rotary_dim, max_positions),
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.decode_kernels = None
        # CUDA, bf16/fp16 dense weights, at most 16 rows: the norms and residual adds (and Qwen3.5's
        # SiLU-mul) of a decode step can run inside the products; only with TRTEDGE_DECODE_FUSION=1, as
        # for the llama family (fused_products may be switched, the decode graphs captured again)
        self.can_fuse_products = device.type == "cuda" and all(_products_fuse(layer) for layer in self.layers)
        self.fused_products = self.can_fuse_products and os.environ.get("TRTEDGE_DECODE_FUSION") == "1"
        # CUDA decode steps: each residual add and the RMSNorm after it in one launch, SiLU-mul in one
        self.norm_kernels = None
        if device.type == "cuda" and triton_attention.available():
            from trtedge.runtime.ops.triton_fused import TritonDecodeKernels

            self.norm_kernels = TritonDecodeKernels()
        self.aux_layers: tuple[int, ...] = ()  # no EAGLE-3 hidden-state taps
        # MTP drafting reads the final (normed) hidden states of every forward: kept in aux_hidden
        self.keep_hidden = False
        self.aux_hidden: torch.Tensor | None = None

    def state_spec(self) -> dict:
        """Shapes of one sequence's recurrent state, per linear-attention layer."""
        lin = self.cfg.linear
        conv_dim = 2 * lin.num_key_heads * lin.key_head_dim + lin.num_value_heads * lin.value_head_dim
        return {
            "num_layers": self.num_linear_layers,
            "conv_shape": (lin.conv_kernel - 1, conv_dim),
            "conv_dtype": self.dtype,
            "ssm_shape": (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim),
        }

    def forward(
        self, input_ids, positions, kv_caches, batch: AttentionBatch, states: RecurrentBatch
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        caches = iter(kv_caches)
        if self.fused_products and states.is_decode and x.shape[0] <= triton_gemv.MAX_ROWS:
            return self._decode_fused_products(x, cos, sin, caches, batch, states)
        if self.norm_kernels is not None and states.is_decode:
            return self._decode_with_kernels(x, cos, sin, caches, batch, states)
        for layer in self.layers:
            h = rms_norm(x, layer.input_norm, layer.eps)
            if isinstance(layer.mixer, GatedDeltaNet):
                x = x + layer.mixer(h, states)
            else:
                k_cache, v_cache = next(caches)
                x = x + layer.mixer(h, cos, sin, k_cache, v_cache, batch)
            x = layer.mlp(x)
        out = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        if self.keep_hidden:
            self.aux_hidden = out
        return out

    def _decode_with_kernels(self, x, cos, sin, caches, batch, states) -> torch.Tensor:
        """A CUDA decode step whose residual adds run with the RMSNorm after them (add_rms_norm, x in
        place) and whose MLP's SiLU-mul is one kernel."""
        kernels, eps = self.norm_kernels, self.cfg.rms_norm_eps
        h, delta = torch.empty_like(x), None
        for layer in self.layers:
            kernels.add_rms_norm(x, delta, layer.input_norm, h, eps)
            if isinstance(layer.mixer, GatedDeltaNet):
                delta = layer.mixer(h, states)
            else:
                k_cache, v_cache = next(caches)
                delta = layer.mixer(h, cos, sin, k_cache, v_cache, batch)
            kernels.add_rms_norm(x, delta, layer.post_norm, h, eps)
            delta = layer.ffn(h, kernels)
        out = torch.empty_like(x)
        kernels.add_rms_norm(x, delta, self.norm, out, eps)
        if self.keep_hidden:
            self.aux_hidden = out
        return out

    def _decode_fused_products(self, x, cos, sin, caches, batch, states) -> torch.Tensor:
        """A decode step whose products read RMSNorm(x) (the mixers' input projections, gate_up),
        SiLU(gate) * up (down) and add into the residual stream x (out / o, down) themselves."""
        eps = self.cfg.rms_norm_eps
        for layer in self.layers:
            mixer = layer.mixer
            if isinstance(mixer, GatedDeltaNet):
                o = mixer.mix(mixer.in_proj.skinny.fused(x, norm=layer.input_norm, eps=eps), states)
                mixer.out_proj.skinny.fused(o, residual=x)
            else:
                k_cache, v_cache = next(caches)
                qkv = mixer.qkv.skinny.fused(x, norm=layer.input_norm, eps=eps)
                mixer.o.skinny.fused(mixer.attend(qkv, cos, sin, k_cache, v_cache, batch), residual=x)
            gate_up = layer.ffn.gate_up.skinny.fused(x, norm=layer.post_norm, eps=eps)
            layer.ffn.down.skinny.fused(gate_up, silu=True, residual=x)
        out = torch.empty_like(x)
        self.norm_kernels.add_rms_norm(x, None, self.norm, out, eps)
        if self.keep_hidden:
            self.aux_hidden = out
        return out

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weight_bytes(self) -> int:
        return sum(m.nbytes for m in [self.lm_head] + [m for layer in self.layers for m in layer.linears])


def hybrid_dummy_tensors(cfg: ModelConfig, rand, zeros, mlp_shapes):
    """Random weights in HF names for ``dummy_tensors`` (norm weights 0: Qwen3.5 scales by 1 + w)."""
    lin, h = cfg.linear, cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    key, value = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
    yield "model.embed_tokens.weight", rand(cfg.vocab_size, h)
    yield "model.norm.weight", zeros(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", rand(cfg.vocab_size, h)
    for i, kind in enumerate(lin.layer_types):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            shapes = {
                "in_proj_qkv.weight": (2 * key + value, h),
                "in_proj_z.weight": (value, h),
                "in_proj_b.weight": (lin.num_value_heads, h),
                "in_proj_a.weight": (lin.num_value_heads, h),
                "conv1d.weight": (2 * key + value, 1, lin.conv_kernel),
                "out_proj.weight": (h, value),
            }
            for name, shape in shapes.items():
                yield p + "linear_attn." + name, rand(*shape)
            yield p + "linear_attn.A_log", zeros(lin.num_value_heads)
            yield p + "linear_attn.dt_bias", zeros(lin.num_value_heads)
            yield p + "linear_attn.norm.weight", zeros(lin.value_head_dim) + 1
        else:
            shapes = {"q_proj": (2 * q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
            for name, shape in shapes.items():
                yield p + f"self_attn.{name}.weight", rand(*shape)
            for name in ("q_norm", "k_norm"):
                yield p + f"self_attn.{name}.weight", zeros(cfg.head_dim)
        for name, shape in mlp_shapes(cfg, i).items():
            yield p + name + ".weight", rand(*shape)
        for name in ("input_layernorm", "post_attention_layernorm"):
            yield p + name + ".weight", zeros(h)
