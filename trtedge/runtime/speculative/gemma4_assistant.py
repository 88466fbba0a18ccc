"""Gemma 4's assistant drafter: ``{"method": "mtp", "model": <assistant checkpoint>}``.

Checkpoint layout (``model_type`` ``gemma4_assistant``, transformers' ``Gemma4AssistantForCausalLM``):
``text_config`` a Gemma 4 text model whose every layer shares keys and values (``model.layers.{i}.*``:
queries, q norm, output projection, the MLP and norms, a layer scalar; no k / v projections, no
per-layer embeddings), ``model.norm.weight``, ``lm_head.weight`` (or ``model.embed_tokens.weight``,
tied), ``pre_projection.weight`` [hidden, 2 x backbone] over ``[target embedding of the token, the
target's final hidden state]`` (the embedding first) and ``post_projection.weight`` [backbone, hidden];
with ``use_ordered_embeddings`` ``masked_embedding.centroids.weight`` [num_centroids, hidden] and
``masked_embedding.token_ordering`` [vocab]: the logits are taken over the tokens of the
``centroid_intermediate_top_k`` best centroids only, the rest set below them.

A layer of kind ``t`` attends, as a cross-attention, to the target's own keys and values of the last
target layer of kind ``t`` that computes them (the one its KV-sharing layers read). A drafting step of a
sequence of ``n`` tokens (token ``n - 1`` not computed yet) reads ``[embed(token n - 1), hidden(n - 2)]``
at rotary position ``n - 1`` over the target keys of positions ``0 .. n - 2`` (a sliding layer: the
last ``sliding_window + 1`` of them, as transformers' bidirectional window counts) and predicts token
``n``; each further step feeds the token it drafted and its post-projected output back in at the same
position over the same keys. So the assistant keeps no cache of its own: one target hidden row per
sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.models.config import ModelConfig
from trtedge.runtime.models.gemma4 import Gemma4Layer, _view, gemma_norm, kv_sources, rope_for
from trtedge.runtime.models.layers import GatedMLP, group_by_layer, require, rotate
from trtedge.runtime.ops import kv_fp8, triton_attention
from trtedge.runtime.ops.attention import TorchAttention
from trtedge.runtime.ops.linear import embedding
from trtedge.runtime.speculative import UnsupportedSpeculativeMethod
from trtedge.runtime.speculative.tree import Draft

ASSISTANT_MODEL_TYPE = "gemma4_assistant"
KEY = "--speculative-config model"
ORDERING = "masked_embedding.token_ordering"


def read_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{KEY}: cannot read the assistant's config.json ({e})") from None


def check_assistant(target_cfg, config: dict) -> None:
    """Refuse an assistant checkpoint the target cannot run, from the configs (before weights load)."""
    kind = config.get("model_type")
    if kind != ASSISTANT_MODEL_TYPE:
        raise UnsupportedSpeculativeMethod(
            f"{KEY}: method mtp with a model takes a Gemma 4 assistant checkpoint (model_type "
            f"{ASSISTANT_MODEL_TYPE}), got model_type {kind!r}; for the checkpoint's own MTP layers leave "
            "model unset, for another draft use method draft_model"
        )
    if target_cfg.model_type != "gemma4_text":
        raise UnsupportedSpeculativeMethod(
            f"{KEY}: a Gemma 4 assistant drafts for Gemma 4 targets, and this target is {target_cfg.model_type}"
        )
    backbone = int(config.get("backbone_hidden_size") or 0)
    if backbone != target_cfg.hidden_size:
        raise UnsupportedSpeculativeMethod(
            f"{KEY}: the assistant's backbone_hidden_size ({backbone}) is not the target's hidden size "
            f"({target_cfg.hidden_size})"
        )
    text = config.get("text_config") or {}
    for name in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(name):
            raise UnsupportedSpeculativeMethod(f"{KEY}: the assistant's text_config.{name} must be 0")
    if text.get("enable_moe_block") or text.get("use_double_wide_mlp"):
        raise UnsupportedSpeculativeMethod(
            f"{KEY}: an assistant with enable_moe_block or use_double_wide_mlp is not supported"
        )
    if int(text.get("vocab_size") or 0) != target_cfg.vocab_size:
        raise UnsupportedSpeculativeMethod(
            f"{KEY}: the assistant's vocab_size ({text.get('vocab_size')}) is not the target's "
            f"({target_cfg.vocab_size})"
        )


class AssistantHead:
    def __init__(self, config: dict, tensors, target, max_positions: int):
        check_assistant(target.cfg, config)
        text = {**config["text_config"], "model_type": "gemma4_text", "num_kv_shared_layers": 0}
        cfg = self.cfg = ModelConfig.from_hf(text, "the assistant's config.json")
        self.target = target
        self.dtype, self.device, self.act_dtype = target.dtype, target.device, target.act_dtype
        ids: dict[str, torch.Tensor] = {}  # token ids stay integers (group_by_layer casts to float dtypes)

        def floats():
            for name, tensor in tensors:
                if name == ORDERING:
                    ids[name] = tensor
                else:
                    yield name, tensor

        per_layer, top = group_by_layer(floats(), cfg.num_layers, self.dtype, self.device, self.act_dtype)
        self.layers = [
            Gemma4Layer(cfg, i, w, "float", True, GatedMLP.from_layer(w, cfg.hidden_act, "float"))
            for i, w in enumerate(per_layer)
        ]
        self.eps = cfg.rms_norm_eps
        self.norm = require(top, "model.norm.weight").float()
        # the head's own products run in the activations' dtype (float32 on the CPU)
        head = top.get("lm_head.weight")
        self.lm_head = (head if head is not None else require(top, "model.embed_tokens.weight")).to(
            self.act_dtype
        )
        backbone, h = target.cfg.hidden_size, cfg.hidden_size
        self.pre = _shaped(top, "pre_projection.weight", (h, 2 * backbone)).to(self.act_dtype)
        self.post = _shaped(top, "post_projection.weight", (backbone, h)).to(self.act_dtype)
        self.centroids = self.ordering = None
        if config.get("use_ordered_embeddings"):
            self.centroids = require(top, "masked_embedding.centroids.weight").to(self.act_dtype)
            self.ordering = require(ids, ORDERING).to(device=self.device, dtype=torch.long)
            self.top_centroids = int(config.get("centroid_intermediate_top_k") or 32)
        types, shapes = cfg.text_config["layer_types"], cfg.text_config["_layer_shapes"]
        ttext = target.cfg.text_config
        producers = {}  # kind -> the target layer whose keys and values it reads
        for i, s in enumerate(kv_sources(ttext)):
            if s == i:
                producers[ttext["layer_types"][i]] = i
        self.cache_index = []
        for i, kind in enumerate(types):
            if kind not in producers:
                raise ValueError(f"{KEY}: assistant layer {i} is {kind}, and the target has no such layer")
            source = producers[kind]
            if tuple(shapes[i]) != tuple(ttext["_layer_shapes"][source]):
                raise ValueError(
                    f"{KEY}: assistant layer {i} ({kind}) has (KV heads, head size) {tuple(shapes[i])}, the "
                    f"target's {tuple(ttext['_layer_shapes'][source])}"
                )
            self.cache_index.append(target.cache_index[source])
        # transformers' bidirectional window keeps keys within distance sliding_window: window + 1 keys
        self.windows = [w + 1 if w else 0 for w in cfg.sliding_windows]
        self.rope = {k: rope_for(cfg, k, max_positions, self.device, self.act_dtype) for k in set(types)}
        self.fused = self.device.type == "cuda" and triton_attention.available()

    def step(
        self, ids, hidden, positions, kv_caches, tables, context_lens
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step of ``B`` rows: ``ids`` [B] tokens, ``hidden`` [B, backbone] (the target's
        state or a previous step's output), ``positions`` [B]; ``tables`` [B, blocks] the target's block
        tables, ``context_lens`` [B] (host list and device tensor) the target keys each row reads.
        Returns (logits [B, vocab] float32, the post-projected output [B, backbone])."""
        target = self.target
        e = (embedding(ids, target.embed) * target.embed_scale).to(self.act_dtype)
        x = F.linear(torch.cat([e, hidden.to(self.act_dtype)], dim=-1), self.pre)
        rope = {
            k: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
            for k, (cos, sin) in self.rope.items()
        }
        for i, layer in enumerate(self.layers):
            attn = layer.attn
            h = layer.norm(x, "input_layernorm")
            t = h.shape[0]
            q = gemma_norm(attn.q(h).view(t, attn.num_heads, attn.head_dim), attn.q_norm, self.eps)
            q = rotate(q, *rope[layer.kind])
            k_cache, v_cache = (_view(c, attn) for c in kv_caches[self.cache_index[i]])
            o = self._attend(q, k_cache, v_cache, tables, context_lens, self.windows[i])
            x = x + layer.norm(attn.o(o.reshape(t, -1)), "post_attention_layernorm")
            h = layer.mlp(layer.norm(x, "pre_feedforward_layernorm"))
            x = x + layer.norm(h, "post_feedforward_layernorm")
            if layer.scalar is not None:
                x = x * layer.scalar.to(x.dtype)
        out = gemma_norm(x, self.norm, self.eps)
        return self._logits(out), F.linear(out, self.post)

    def _attend(self, q, k_cache, v_cache, tables, context_lens, window: int) -> torch.Tensor:
        """Each query row over its sequence's target keys (read only: the assistant writes no cache)."""
        pad = kv_fp8.head_dim(k_cache) - q.shape[-1]
        qp = F.pad(q, (0, pad)) if pad else q
        host, device_lens = context_lens
        if self.fused:
            from trtedge.runtime.ops.triton_attention import paged_decode_attention

            o = paged_decode_attention(qp, k_cache, v_cache, tables, device_lens, 1.0, window=window)
        else:
            reference = TorchAttention(1.0, window)
            o = torch.empty_like(qp)
            bs = k_cache.shape[1]
            for r, ctx in enumerate(host):
                table = tables[r, : -(-ctx // bs)]
                keys = kv_fp8.read(k_cache[table].flatten(0, 1)[:ctx], qp.dtype)
                values = kv_fp8.read(v_cache[table].flatten(0, 1)[:ctx], qp.dtype)
                o[r : r + 1] = reference._attend(qp[r : r + 1], keys, values, ctx - 1)
        return o[..., : q.shape[-1]] if pad else o

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.centroids is None:
            return F.linear(out, self.lm_head).float()
        # the tokens of the best centroids only; every other token one below the row's lowest logit
        b, num = out.shape[0], self.centroids.shape[0]
        best = F.linear(out, self.centroids).topk(self.top_centroids, dim=-1).indices
        ids = self.ordering.view(num, -1)[best].reshape(b, -1)  # [B, top x tokens per centroid]
        picked = torch.einsum("bh,bkh->bk", out, self.lm_head[ids]).float()
        logits = (picked.min(dim=-1, keepdim=True).values - 1.0).expand(b, self.lm_head.shape[0]).clone()
        return logits.scatter_(1, ids, picked)


def _shaped(tensors: dict, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = require(tensors, name)
    if tuple(t.shape) != shape:
        raise ValueError(f"{KEY}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def load_assistant(path: str | Path, target, max_positions: int) -> AssistantHead:
    """The Gemma 4 assistant in ``path`` (its config.json and safetensors) for ``target``."""
    from safetensors import safe_open

    config = read_config(path)
    check_assistant(target.cfg, config)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{KEY}: {path} has no .safetensors weights")

    def tensors():
        for file in files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return AssistantHead(config, tensors(), target, max_positions)


class AssistantProposer:
    """Drafts with an ``AssistantHead``: keeps each sequence's latest target hidden row (position
    ``num_computed_tokens - 1``), from plain steps and verification, and nothing else."""

    def __init__(self, head: AssistantHead, runner, config):
        self.head = head
        self.runner = runner
        self.top_k = config.draft_top_k
        self.max_nodes = config.verify_tokens
        head.target.keep_hidden = True
        self.rows: dict[int, tuple[int, torch.Tensor]] = {}  # seq id -> (position, target hidden row)

    def observe(self, seqs: list[Sequence], num_tokens: list[int], aux: torch.Tensor | None) -> None:
        offset = 0
        for seq, n in zip(seqs, num_tokens):
            offset += n
            if aux is not None and not seq.params.disable_spec_decode:
                self.rows[seq.seq_id] = (seq.num_computed_tokens - 1, aux[offset - 1].clone())

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        if aux is None:
            self.rows.pop(seq.seq_id, None)
        else:
            self.rows[seq.seq_id] = (seq.num_computed_tokens - 1, aux[-1].clone())

    def release(self, seq: Sequence) -> None:
        self.rows.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft | None]:
        live = []
        for i, seq in enumerate(seqs):
            row = self.rows.get(seq.seq_id)
            if row is not None and row[0] == seq.num_tokens - 2 and limits[i] > 0:
                live.append(i)
        drafts: list[Draft | None] = [None] * len(seqs)
        if not live:
            return drafts
        if self.top_k > 1:
            for i in live:
                drafts[i] = self._tree(seqs[i], limits[i])
            return drafts
        device = self.head.device
        ids = torch.tensor([seqs[i].token_ids[-1] for i in live], dtype=torch.long, device=device)
        hidden = torch.stack([self.rows[seqs[i].seq_id][1] for i in live])
        batch = self._batch([seqs[i] for i in live])
        steps = []
        for _ in range(max(limits[i] for i in live)):
            logits, hidden = self.head.step(ids, hidden, *batch)
            ids = logits.argmax(dim=-1)
            steps.append(ids)
        values = torch.stack(steps, dim=1).tolist()  # the host's one read of the chains
        for j, i in enumerate(live):
            drafts[i] = Draft.chain(values[j][: limits[i]])
        return drafts

    def _batch(self, seqs: list[Sequence]):
        """(positions, kv caches, tables, (host, device) context lengths) of one row per sequence."""
        device, bs = self.head.device, self.runner.block_size
        lens = [seq.num_tokens - 1 for seq in seqs]
        tables = [
            torch.tensor(seq.block_table[: -(-n // bs)], dtype=torch.long) for seq, n in zip(seqs, lens)
        ]
        tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device)
        positions = torch.tensor(lens, dtype=torch.long, device=device)
        context = (lens, torch.tensor(lens, dtype=torch.int32, device=device))
        return positions, self.runner.kv_caches, tables, context

    def _tree(self, seq: Sequence, depth: int) -> Draft | None:
        """Best-first token tree: every level expands the ``top_k`` best nodes of the level before, each
        with its ``top_k`` most likely tokens; the ``verify_tokens`` best nodes (by the sum of their
        path's log-probabilities) whose parents are kept form the draft."""
        k, head = self.top_k, self.head
        tokens, parents, scores, depths = [-1], [-1], [0.0], [0]
        frontier = [0]
        inputs = torch.tensor([seq.token_ids[-1]], dtype=torch.long, device=head.device)
        hidden = self.rows[seq.seq_id][1].unsqueeze(0)
        positions, caches, tables, (lens, lens_t) = self._batch([seq])
        for level in range(depth):
            n = len(frontier)  # rows of one sequence: the kernels read contiguous tables and lengths
            rows = (positions.repeat(n), caches, tables.repeat(n, 1), (lens * n, lens_t.repeat(n)))
            logits, out = head.step(inputs, hidden, *rows)
            logp, top = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
            children, parent_rows = [], []
            for r, (values, ids) in enumerate(zip(logp.tolist(), top.tolist())):
                for value, token in zip(values, ids):
                    tokens.append(token)
                    parents.append(frontier[r])
                    scores.append(scores[frontier[r]] + value)
                    depths.append(level + 1)
                    children.append(len(tokens) - 1)
                    parent_rows.append(r)
            if level + 1 == depth:
                break
            best = sorted(range(len(children)), key=lambda c: -scores[children[c]])[:k]
            frontier = [children[c] for c in best]
            pick = torch.tensor([parent_rows[c] for c in best], device=head.device)
            inputs = torch.tensor([tokens[c] for c in frontier], dtype=torch.long, device=head.device)
            hidden = out.index_select(0, pick)
        order = sorted(range(1, len(tokens)), key=lambda n: (-scores[n], depths[n], n))
        chosen: set[int] = set()
        for node in order:
            if len(chosen) == self.max_nodes:
                break
            if parents[node] == 0 or parents[node] in chosen:
                chosen.add(node)
        nodes = sorted(chosen, key=lambda n: (depths[n], n))
        index = {0: 0} | {n: j + 1 for j, n in enumerate(nodes)}
        return Draft([tokens[n] for n in nodes], [index[parents[n]] for n in nodes]) if nodes else None
