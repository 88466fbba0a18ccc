"""MTP: the multi-token-prediction layers a checkpoint ships beside its model draft a chain.

Checkpoint layout (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: ``mtp_num_hidden_layers`` in the text config;
transformers does not load these tensors):
``mtp.pre_fc_norm_embedding.weight`` and ``mtp.pre_fc_norm_hidden.weight`` (zero-centred RMSNorms,
scale 1 + w), ``mtp.fc.weight`` [hidden, 2 x hidden] over ``[norm(embed(token)), norm(hidden)]``
(the embedding first), ``mtp.layers.{i}.*``: a full-attention decoder layer of the family (gated
attention with q/k norms and partial rotary; a dense MLP or the MoE block), ``mtp.norm.weight``. The
embedding and the lm head are the model's own (``mtp.embed_tokens.weight`` replaces the embedding
where a checkpoint has one).

Draft row ``p`` combines the target's final (normed) hidden state at position ``p`` with token
``p + 1`` at rotary position ``p`` and predicts token ``p + 2``; each further chain step feeds the
layer's own normed output and the token it drafted back in, one position on. The first MTP layer
drafts every step (as vLLM runs these checkpoints; the released ones have one). Nemotron-H's MTP
module (``num_nextn_predict_layers``) is laid out differently: see ``NemotronHMtpHead``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.sampler import to_device
from trtedge.runtime.ops.linear import embedding
from trtedge.runtime.speculative import UnsupportedSpeculativeMethod
from trtedge.runtime.speculative.draft_cache import DraftCache, Row, TargetHiddens, draft_chains, last_rows
from trtedge.runtime.speculative.head_graphs import HeadGraphSpec, capture_or_eager
from trtedge.runtime.speculative.tree import DeviceChains, Draft

MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h")
PREFIX = "mtp."


def check_mtp(cfg) -> None:
    """Refuse ``mtp`` for a model whose checkpoint has no MTP layers trtedge can run (before loading)."""
    if not cfg.num_mtp_layers:
        raise UnsupportedSpeculativeMethod(
            f"--speculative-config method mtp needs the checkpoint's multi-token-prediction layers, and "
            f"this {cfg.model_type} checkpoint has none (config.json: no mtp_num_hidden_layers or "
            "num_nextn_predict_layers); use ngram, draft_model or eagle3"
        )
    if cfg.model_type not in MTP_MODEL_TYPES:
        raise UnsupportedSpeculativeMethod(
            f"--speculative-config method mtp is not supported for {cfg.model_type} yet (its "
            f"multi-token-prediction layers are not implemented; mtp runs on {', '.join(MTP_MODEL_TYPES)}); "
            "use ngram or draft_model"
        )


class _NotMtp:
    """The names a checkpoint read skips: everything but the MTP tensors."""

    def __contains__(self, name: str) -> bool:
        return not name.removeprefix("language_model.").startswith(PREFIX)


class MtpHead:
    def __init__(self, target, tensors: dict[str, torch.Tensor]):
        from trtedge.runtime.models.moe import expert_names
        from trtedge.runtime.models.qwen3_5 import GatedAttention, Qwen35Layer

        cfg = self.cfg = target.cfg
        self.dtype, self.device = target.dtype, target.device
        w = {k.removeprefix(PREFIX): v.to(device=self.device, dtype=self.dtype) for k, v in tensors.items()}
        self.eps = cfg.rms_norm_eps
        self.fc = _require(w, "fc.weight", (cfg.hidden_size, 2 * cfg.hidden_size))
        self.norm_embedding = 1.0 + _require(w, "pre_fc_norm_embedding.weight").float()
        self.norm_hidden = 1.0 + _require(w, "pre_fc_norm_hidden.weight").float()
        self.norm = 1.0 + _require(w, "norm.weight").float()
        self.embed = w.get("embed_tokens.weight", target.embed)
        layer = {k.removeprefix("layers.0."): v for k, v in w.items() if k.startswith("layers.0.")}
        if not layer:
            raise ValueError("MTP layers: checkpoint has no tensors 'mtp.layers.0.*'")
        _require(layer, "self_attn.o_proj.weight")
        router = expert_names(cfg)[0] + ".weight" if cfg.num_experts else None
        mixer = GatedAttention(cfg, layer, "float", self.eps)
        self.layer = Qwen35Layer(cfg, layer, "float", mixer, 0, sparse=router is not None and router in layer)
        self.target = target
        self.num_kv_layers = 1

    def forward(self, ids, hidden, positions, kv_caches, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: [T, hidden] the target's final states (or this layer's outputs, chained).
        Returns (logits over the vocabulary, the normed output the next step reads)."""
        from trtedge.runtime.models.qwen3_5 import rms_norm

        e = rms_norm(embedding(ids, self.embed), self.norm_embedding, self.eps)
        h = rms_norm(hidden, self.norm_hidden, self.eps)
        x = F.linear(torch.cat([e, h], dim=-1), self.fc)
        target = self.target
        cos, sin = target.cos[positions].unsqueeze(1), target.sin[positions].unsqueeze(1)
        layer = self.layer
        x = x + layer.mixer(rms_norm(x, layer.input_norm, self.eps), cos, sin, *kv_caches[0], attn)
        out = rms_norm(layer.mlp(x), self.norm, self.eps)
        return target.logits(out), out


_NEMOTRON_BLOCKS = {"*": "full_attention", "attention": "full_attention", "E": "moe", "-": "mlp"}


class NemotronHMtpHead:
    """Nemotron-H's MTP module (``num_nextn_predict_layers``): blocks ``mtp.layers.{i}`` of the kinds
    ``mtp_layers_block_type`` lists (attention and MoE in the released ones), each ``x + mixer(norm(x))``;
    the first also holds ``enorm``, ``hnorm`` and ``eh_proj`` [hidden, 2 x hidden] over
    ``[enorm(embed(token)), hnorm(hidden)]``, the last ``final_layernorm`` (plain RMSNorms)."""

    def __init__(self, target, tensors: dict[str, torch.Tensor]):
        from trtedge.runtime.models.nemotron_h import MLP, Attention, NemotronHLayer, RoutedMoE

        cfg = self.cfg = target.cfg
        self.dtype, self.device, self.target = target.dtype, target.device, target
        raw = cfg.text_config or {}
        kinds = raw.get("mtp_layers_block_type") or list(raw.get("mtp_hybrid_override_pattern") or "")
        kinds = [_NEMOTRON_BLOCKS.get(k, k) for k in kinds]
        if not kinds or any(k not in ("full_attention", "moe", "mlp") for k in kinds):
            raise ValueError(
                f"MTP layers: mtp_layers_block_type {kinds} is not a list of full_attention, moe and mlp blocks"
            )
        keep = ("gate.weight", "e_score_correction_bias")
        w = {}
        for k, v in tensors.items():
            dtype = torch.float32 if k.endswith(keep) else self.dtype
            w[k.removeprefix("language_model.").removeprefix(PREFIX)] = v.to(device=self.device, dtype=dtype)
        h, last = cfg.hidden_size, len(kinds) - 1
        self.eps = cfg.rms_norm_eps
        self.enorm = _require(w, "layers.0.enorm.weight").float()
        self.hnorm = _require(w, "layers.0.hnorm.weight").float()
        self.eh_proj = _require(w, "layers.0.eh_proj.weight", (h, 2 * h))
        self.final_norm = _require(w, f"layers.{last}.final_layernorm.weight").float()
        self.embed = w.get("embeddings.weight", target.embed)
        self.blocks = []
        for i, kind in enumerate(kinds):
            lw = {k.removeprefix(f"layers.{i}."): v for k, v in w.items() if k.startswith(f"layers.{i}.")}
            if kind == "full_attention":
                mixer = Attention(cfg, lw, "float")
            elif kind == "moe":
                mixer = RoutedMoE(target.spec, lw, "float", self.dtype)
            else:
                mixer = MLP.from_layer(lw, "mixer.", target.spec.mlp_act, "float")
            self.blocks.append(NemotronHLayer(kind, _require(lw, "norm.weight").float(), mixer))
        self.num_kv_layers = sum(kind == "full_attention" for kind in kinds)

    def forward(self, ids, hidden, positions, kv_caches, attn) -> tuple[torch.Tensor, torch.Tensor]:
        from trtedge.runtime.models.nemotron_h import rms_norm

        e = rms_norm(embedding(ids, self.embed), self.enorm, self.eps)
        x = F.linear(torch.cat([e, rms_norm(hidden, self.hnorm, self.eps)], dim=-1), self.eh_proj)
        caches = iter(kv_caches)
        for block in self.blocks:
            h = rms_norm(x, block.norm, self.eps)
            if block.kind == "full_attention":
                x = x + block.mixer(h, *next(caches), attn)  # no positional encoding in Nemotron-H
            else:
                x = x + block.mixer(h)
        out = rms_norm(x, self.final_norm, self.eps)
        return self.target.logits(out), out


def load_mtp(checkpoint, target, load_format: str = "auto"):
    """The MTP head of ``target`` from its checkpoint (or bundle): only the ``mtp.*`` tensors are read.
    ``load_format`` dummy: random weights of the layout (seeded), to measure a model's shape."""
    from trtedge.runtime.artifacts.quantize import QuantizedTensor

    check_mtp(target.cfg)
    nemotron = target.cfg.model_type == "nemotron_h"
    if load_format == "dummy":
        if nemotron:
            raise ValueError(
                "load_format (--load-format) dummy: Nemotron-H MTP layers have no random-weight layout yet"
            )
        return MtpHead(target, dict(random_mtp_tensors(target.cfg, target.dtype, target.device)))
    tensors = {}
    for name, tensor in checkpoint.iter_tensors(_NotMtp()):
        if not name.removeprefix("language_model.").startswith(PREFIX):
            continue
        if isinstance(tensor, QuantizedTensor):  # the head runs float weights
            tensor = tensor.dequantize(target.dtype)
        tensors[name] = tensor
    if not tensors:
        raise ValueError(
            f"{checkpoint.name}: config.json declares {target.cfg.num_mtp_layers} multi-token-prediction "
            "layer(s) but the checkpoint has no 'mtp.*' tensors"
        )
    return NemotronHMtpHead(target, tensors) if nemotron else MtpHead(target, tensors)


def random_mtp_tensors(cfg, dtype: torch.dtype, device: torch.device):
    """Random ``mtp.*`` weights (std 0.02, norms 0: scale 1, seed 0) of one MTP layer for ``cfg``."""
    from dataclasses import replace

    from trtedge.runtime.models import _mlp_shapes

    generator = torch.Generator(device=device).manual_seed(0)
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, generator=generator) * 0.02

    yield PREFIX + "fc.weight", rand(h, 2 * h)
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        yield PREFIX + name + ".weight", torch.zeros(h, dtype=dtype, device=device)
    p = PREFIX + "layers.0."
    for name, shape in (("q_proj", (2 * q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
        yield p + f"self_attn.{name}.weight", rand(*shape)
    for name in ("self_attn.q_norm", "self_attn.k_norm"):
        yield p + name + ".weight", torch.zeros(hd, dtype=dtype, device=device)
    for name in ("input_layernorm", "post_attention_layernorm"):
        yield p + name + ".weight", torch.zeros(h, dtype=dtype, device=device)
    sparse = replace(cfg, sparse_layers=(bool(cfg.num_experts),) * cfg.num_layers)
    for name, shape in _mlp_shapes(sparse, 0).items():
        yield p + name + ".weight", rand(*shape)


class MtpProposer:
    def __init__(self, head, target, num_blocks: int, block_size: int, graphs: HeadGraphSpec | None = None):
        """``head``: an ``MtpHead`` or ``NemotronHMtpHead`` (``load_mtp``); ``graphs``: draft in CUDA
        graphs (``head_graphs``) of that geometry, else eagerly."""
        if head is None:
            raise ValueError("--speculative-config method mtp: no MTP layers were loaded for the target")
        self.head = head
        cfg = target.cfg
        target.keep_hidden = True  # every target forward keeps its final hidden states for the head
        self.cache = DraftCache(
            head.num_kv_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            num_blocks,
            block_size,
            head.dtype,
            head.device,
            scratch=graphs is not None,
        )
        self.kv = self.cache.kv_caches
        self.hiddens = TargetHiddens(self.cache, cfg.hidden_size, head.dtype, head.device)
        self.graphs = None
        if graphs is not None:
            self.graphs = capture_or_eager(
                "mtp", lambda: graphs.build(self._step, self.cache, cfg.hidden_size, cfg.hidden_size)
            )

    def observe(self, seqs: list[Sequence], num_tokens: list[int], aux: torch.Tensor | None) -> None:
        self.hiddens.observe(seqs, num_tokens, aux)

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        self.hiddens.verified(seq, path, aux)

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)

    def _step(self, tokens, hidden, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self.head.forward(tokens, hidden, positions, self.kv, attn)
        return logits.argmax(dim=-1), hidden

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> DeviceChains | list[Draft | None]:
        graphs = self.graphs
        rows, hiddens, live = [], [], []
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            st = self.cache.state(seq)
            n = seq.num_tokens
            start = min(st.num_computed_tokens, n - 2)
            # rows 0..n-2 hold the real tokens; the chain's steps 1..k-1 write the k - 1 rows after them
            if start < 0 or not self.cache.reserve(st, n - 2 + k):
                continue
            rows.append(Row(st, seq.token_ids[start + 1 : n], list(range(start, n - 1)), start))
            hiddens.append(self.hiddens.take(st, start, n - 1))
            live.append(i)
        if not rows:
            return [None] * len(seqs)
        for row, i in zip(rows, live):
            row.state.num_computed_tokens = seqs[i].num_tokens - 1  # chained rows are redrafted next time
        depths = [limits[i] for i in live]
        # the chains stay on the device: the verifier reads them back with its verdict
        if graphs is not None and graphs.takes(rows, depths):
            seq_ids = [seqs[i].seq_id for i in live]
            return graphs.propose(rows, hiddens, seq_ids, depths, live, len(seqs))
        ids, positions, attn = self.cache.attention_batch(rows)
        logits, out = self.head.forward(ids, torch.cat(hiddens), positions, self.kv, attn)
        last = to_device(last_rows(rows), torch.long, logits.device)
        tokens, hidden = logits.index_select(0, last).argmax(dim=-1), out.index_select(0, last)
        ends = [seqs[i].num_tokens - 1 for i in live]
        states = [row.state for row in rows]
        return draft_chains(self._step, self.cache, states, ends, depths, live, len(seqs), tokens, hidden)


def _require(tensors: dict, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"MTP layers: checkpoint has no tensor {PREFIX + name!r}")
    if shape is not None and tuple(tensors[name].shape) != shape:
        raise ValueError(
            f"MTP layers: tensor {PREFIX + name!r} has shape {tuple(tensors[name].shape)}, expected {shape}"
        )
    return tensors[name]
