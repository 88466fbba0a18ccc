"""DFlash: a block-diffusion drafter (z-lab). One draft forward proposes a whole block: the anchor (the
last token, which the target has not computed yet) and ``block_size - 1`` mask tokens at the positions
after it, all attending to each other and to the context, are denoised at once into the drafts.

Checkpoint layout (``architectures: ["DFlashDraftModel"]``, a Qwen3 config with ``dflash_config``:
``target_layer_ids``, ``block_size``, ``mask_token_id``; the keys may also sit at the top level):
``fc.weight`` [hidden, len(target_layer_ids) x hidden] fuses the target's hidden states after those
layers (transformers' ``hidden_states[i + 1]``: the output of layer ``i``, the last one normed), then
``hidden_norm``; ``layers.{i}.*``: Qwen3 decoder layers (q/k norms) whose attention takes its queries
from the block and its keys and values from ``[context, block]``: the context rows are the fused target
states, projected by each layer's ``k_proj`` / ``v_proj`` (no input norm, no MLP); ``norm.weight``.
The embedding (times ``input_embedding_scale``, default 1) and the lm head (times ``output_multiplier``,
then ``final_logit_softcapping`` if set) are the target's. No causal mask inside the block.

Here the context keys and values of every layer live in the proposer's paged cache, appended as the
target's hidden states arrive; the block's are written after them and overwritten by the next catch-up.

With ``draft_top_k`` > 1 a greedy request verifies a token tree built from the block's per-position
distributions (DDTree): a best-first search over paths scored by the sum of their tokens' draft
log-probabilities (each position's ``draft_top_k`` best tokens), up to ``verify_tokens`` nodes; the
first child of every node is its position's best token, so the tree's first path is the linear draft.
Sampled requests verify that linear draft (the reference server's contract).
"""

from __future__ import annotations

import heapq
from pathlib import Path

import torch
import torch.nn.functional as F

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.sampler import to_device
from trtedge.runtime.models.layers import rms_norm, rotate
from trtedge.runtime.models.rope import rope_tables
from trtedge.runtime.ops import triton_attention
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import embedding
from trtedge.runtime.speculative import SpeculativeConfigError, UnsupportedSpeculativeMethod
from trtedge.runtime.speculative.draft_cache import DraftCache, TargetHiddens
from trtedge.runtime.speculative.head_files import read_head
from trtedge.runtime.speculative.head_graphs import BlockGraphs, HeadGraphSpec, capture_or_eager
from trtedge.runtime.speculative.tree import DeviceChains, Draft

ARCHITECTURES = ("DFlashDraftModel",)


def _setting(config: dict, name: str, default=None):
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


class DFlashHead:
    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], target, max_positions: int = 8192):
        from trtedge.runtime.models.config import _rope_config

        dtype, device = getattr(target, "act_dtype", target.dtype), target.device
        w = {k.removeprefix("model."): v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        hidden = target.cfg.hidden_size
        self.dtype, self.device, self.target = dtype, device, target
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or hidden // self.num_heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.block_size = int(_setting(config, "block_size", 16))
        self.mask_token_id = _setting(config, "mask_token_id")
        ids = _setting(config, "target_layer_ids")
        num_layers = target.cfg.num_layers
        if not ids or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
            raise ValueError(
                f"DFlash draft: target_layer_ids {ids} must name layers of the {num_layers}-layer target"
            )
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < target.cfg.vocab_size:
            raise ValueError(
                f"DFlash draft: mask_token_id {self.mask_token_id!r} is not a token of the target"
            )
        if self.block_size < 2:
            raise ValueError(f"DFlash draft: block_size must be at least 2, got {self.block_size}")
        if int(config.get("hidden_size", hidden)) != hidden:
            raise ValueError(
                f"DFlash draft: hidden_size {config['hidden_size']} differs from the target's ({hidden})"
            )
        # target taps: the input of layer i + 1 (index num_layers: the final state, normed here)
        self.taps = tuple(i + 1 for i in ids)
        self.embed_scale = float(_setting(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(_setting(config, "output_multiplier", 1.0))
        self.softcap = _setting(config, "final_logit_softcapping")
        self.fc = _require(w, "fc.weight", (hidden, len(ids) * hidden))
        self.hidden_norm = _require(w, "hidden_norm.weight")
        self.norm = _require(w, "norm.weight")
        self.layers = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"layers.{i}."
            qkv = [_require(w, f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            self.layers.append(
                {
                    "q": qkv[0],
                    "kv": torch.cat(qkv[1:]),
                    "o": _require(w, f"{p}self_attn.o_proj.weight"),
                    "q_norm": _require(w, f"{p}self_attn.q_norm.weight"),
                    "k_norm": _require(w, f"{p}self_attn.k_norm.weight"),
                    "input_norm": _require(w, f"{p}input_layernorm.weight"),
                    "post_norm": _require(w, f"{p}post_attention_layernorm.weight"),
                    "gate_up": torch.cat(
                        [_require(w, f"{p}mlp.gate_proj.weight"), _require(w, f"{p}mlp.up_proj.weight")]
                    ),
                    "down": _require(w, f"{p}mlp.down_proj.weight"),
                }
            )
        if not self.layers:
            raise ValueError("DFlash draft: num_hidden_layers must be at least 1")
        rope = _rope_config(config, "DFlash draft", "full_attention")
        # a block's rows reach block_size - 1 positions past the last one the target may take
        cos, sin = rope_tables(rope, self.head_dim, self.head_dim, max_positions + self.block_size)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        on_cuda = device.type == "cuda" and triton_attention.available()
        self.attention = (CudaAttention if on_cuda else TorchAttention)(self.head_dim**-0.5)

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """The context rows every layer's keys and values read: fc over the target's tapped states."""
        target = self.target
        if target.cfg.num_layers in self.taps:  # the last layer's output is normed, as transformers gives it
            chunks = list(taps.chunk(len(self.taps), dim=-1))
            j = self.taps.index(target.cfg.num_layers)
            chunks[j] = target.layers[0].norm(chunks[j], target.norm)
            taps = torch.cat(chunks, dim=-1)
        return rms_norm(F.linear(taps, self.fc), self.hidden_norm, self.eps)

    def _kv(self, layer: dict, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        t, kv_size = x.shape[0], self.num_kv_heads * self.head_dim
        k, v = F.linear(x, layer["kv"]).split([kv_size, kv_size], dim=-1)
        k = rms_norm(k.view(t, self.num_kv_heads, self.head_dim), layer["k_norm"], self.eps)
        return rotate(k, cos, sin), v.view(t, self.num_kv_heads, self.head_dim)

    def forward(self, context, ids, positions, kv_caches, attn: AttentionBatch) -> torch.Tensor:
        """Denoise the block rows ``ids`` (every sequence's anchor and masks) over the ``context``
        rows (fused target states, ``features``) that precede them in the caches. ``positions``: the
        context rows' then the block rows'; ``attn``: one decode row per block row, seeing its
        sequence's whole context and block, and writing the context's then the block's keys and values
        (``block_batch``). Returns the logits of every block row."""
        t = ids.shape[0]
        x = embedding(ids, self.target.embed).to(self.dtype) * self.embed_scale
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        q_cos, q_sin = cos[-t:], sin[-t:]
        q_size = self.num_heads * self.head_dim
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = rms_norm(x, layer["input_norm"], self.eps)
            q = F.linear(h, layer["q"]).view(t, self.num_heads, self.head_dim)
            q = rotate(rms_norm(q, layer["q_norm"], self.eps), q_cos, q_sin)
            k, v = self._kv(layer, torch.cat([context, h]) if context.shape[0] else h, cos, sin)
            o = self.attention(q, k, v, k_cache, v_cache, attn)
            x = x + F.linear(o.reshape(t, q_size), layer["o"])
            gate, up = F.linear(rms_norm(x, layer["post_norm"], self.eps), layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        logits = self.target.logits(rms_norm(x, self.norm, self.eps)) * self.output_multiplier
        if self.softcap:
            logits = torch.tanh(logits / float(self.softcap)) * float(self.softcap)
        return logits

    def block_batch(self, entries: list[tuple[list[int], int, int]], block_size: int) -> AttentionBatch:
        """The attention batch of one draft forward: per sequence (block table, first context position
        this forward writes, the anchor's position), its context rows' slots, then every sequence's
        block rows' slots; each block row a decode row whose context is the sequence's context and
        block (no causal mask: on CUDA the Triton decode kernel takes them all)."""
        context_slots, block_slots, lens, tables = [], [], [], []
        n_rows = self.block_size
        for table, start, anchor in entries:

            def slot(p, table=table):
                return table[p // block_size] * block_size + p % block_size

            context_slots += [slot(p) for p in range(start, anchor)]
            block_slots += [slot(p) for p in range(anchor, anchor + n_rows)]
            end = anchor + n_rows
            lens += [end] * n_rows
            tables.append(table[: -(-end // block_size)])
        device, cuda = self.device, isinstance(self.attention, CudaAttention)
        per_seq = [] if cuda else [torch.tensor(t, dtype=torch.long, device=device) for t in tables]
        slots = context_slots + block_slots
        padded: list[int] = []
        if cuda:  # the Triton decode kernel reads the tables and lengths on the device
            width = max(len(t) for t in tables)
            for t in tables:
                padded += (t + [t[-1]] * (width - len(t))) * n_rows
        staged = to_device(slots + padded + lens, torch.long, device)  # one copy, not waiting for the queue
        batch = AttentionBatch(
            slot_mapping=staged[: len(slots)],
            query_lens=[1] * len(lens),
            context_lens=lens,
            block_tables=[t for t in per_seq for _ in range(n_rows)],  # the reference path's
            block_size=block_size,
        )
        if cuda:
            rest = staged[len(slots) :].to(torch.int32)
            batch.tables_tensor = rest[: len(padded)].view(len(lens), width)
            batch.context_lens_tensor = rest[len(padded) :]
        return batch


def load_dflash(path: str | Path, target, max_positions: int, num_speculative_tokens: int) -> DFlashHead:
    """A DFlash draft from its directory (config.json + safetensors) for ``target``."""
    config, tensors = read_head(path, "DFlash draft", ARCHITECTURES)
    head = DFlashHead(config, tensors, target, max_positions)
    if num_speculative_tokens > head.block_size - 1:
        raise SpeculativeConfigError(
            f"--speculative-config num_speculative_tokens ({num_speculative_tokens}) must not exceed the "
            f"DFlash draft's block_size - 1 ({head.block_size - 1}): one block holds the anchor and the proposals"
        )
    return head


def draft_tree(logprobs: torch.Tensor, tokens: torch.Tensor, budget: int) -> Draft:
    """The DDTree over a block: ``logprobs`` / ``tokens`` [depth, top_k] each position's best tokens,
    best first. Nodes are taken best path score first (a node's score: its parent's plus its own
    log-probability), at most ``budget``; a node's first child is its position's best token."""
    depth, top_k = logprobs.shape
    lp, ids = logprobs.tolist(), tokens.tolist()
    out_tokens: list[int] = []
    parents: list[int] = []
    heap = [(-lp[0][0], 0, 0, 0, 0)]  # (-score, order pushed, position, rank, parent node)
    order = 1
    while heap and len(out_tokens) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        out_tokens.append(ids[d][r])
        parents.append(parent)
        node = len(out_tokens)
        if r + 1 < top_k:  # the next-best token at this position, same parent
            heapq.heappush(heap, (neg + lp[d][r] - lp[d][r + 1], order, d, r + 1, parent))
            order += 1
        if d + 1 < depth:  # this node's best child
            heapq.heappush(heap, (neg - lp[d + 1][0], order, d + 1, 0, node))
            order += 1
    return Draft(out_tokens, parents)


class DFlashProposer:
    def __init__(
        self,
        head: DFlashHead,
        target,
        config,
        num_blocks: int,
        block_size: int,
        graphs: HeadGraphSpec | None = None,
    ):
        """``graphs``: linear drafts (``draft_top_k`` 1) in CUDA graphs (``head_graphs.BlockGraphs``)
        of that geometry (``max_rows`` block rows), else eagerly."""
        if head is None:
            raise UnsupportedSpeculativeMethod(
                "--speculative-config method dflash: no DFlash draft was loaded"
            )
        self.head = head
        self.top_k, self.max_nodes = config.draft_top_k, config.verify_tokens
        target.aux_layers = head.taps  # the target keeps these layers' inputs from every forward
        graphs = graphs if self.top_k == 1 else None
        self.cache = DraftCache(
            head.num_kv_layers,
            head.num_kv_heads,
            head.head_dim,
            num_blocks,
            block_size,
            head.dtype,
            head.device,
            scratch=graphs is not None,
        )
        width = len(head.taps) * target.cfg.hidden_size
        self.hiddens = TargetHiddens(self.cache, width, head.dtype, head.device)
        self.graphs = None
        if graphs is not None:  # a verified chain brings its accepted tokens and the bonus one
            self.graphs = capture_or_eager(
                "dflash",
                lambda: BlockGraphs(
                    head,
                    self.cache,
                    width,
                    config.num_speculative_tokens + 1,
                    max(1, graphs.max_rows // head.block_size),
                    graphs.max_blocks,
                    graphs.capture,
                ),
            )

    def observe(self, seqs: list[Sequence], num_tokens: list[int], aux: torch.Tensor | None) -> None:
        self.hiddens.observe(seqs, num_tokens, aux)

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        self.hiddens.verified(seq, path, aux)

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> DeviceChains | list[Draft | None]:
        head = self.head
        taps, context_positions, block_ids, block_positions, entries, live = [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            st = self.cache.state(seq)
            n = seq.num_tokens  # the target has computed n - 1 of them: the anchor is token n - 1
            start = min(st.num_computed_tokens, n - 1)
            if not self.cache.reserve(st, n - 1 + head.block_size):
                continue
            taps.append(self.hiddens.take(st, start, n - 1))
            context_positions += range(start, n - 1)
            block_ids += [seq.token_ids[-1]] + [head.mask_token_id] * (head.block_size - 1)
            block_positions += range(n - 1, n - 1 + head.block_size)
            entries.append((st.block_table, start, n - 1))
            st.num_computed_tokens = n - 1  # the block's rows are rewritten by the next catch-up
            live.append(i)
        if not live:
            return [None] * len(seqs)
        if self.graphs is not None and self.graphs.takes([anchor - start for _, start, anchor in entries]):
            chains: list[int | None] = [None] * len(seqs)
            lengths = [0] * len(seqs)
            for j, i in enumerate(live):
                chains[i], lengths[i] = j, limits[i]
            tokens = self.graphs.propose(
                [(seqs[i].seq_id, *entry) for i, entry in zip(live, entries)], taps, block_ids
            )
            return DeviceChains(tokens, chains, lengths)
        staged = to_device(block_ids + context_positions + block_positions, torch.long, head.device)
        attn = head.block_batch(entries, self.cache.block_size)
        logits = head.forward(
            head.features(torch.cat(taps)),
            staged[: len(block_ids)],
            staged[len(block_ids) :],
            self.cache.kv_caches,
            attn,
        )
        logits = logits.view(len(live), head.block_size, -1)[:, 1:]
        drafts: list[Draft | None] = [None] * len(seqs)
        if self.top_k == 1:  # the chains stay on the device: the verifier reads them with its verdict
            rows: list[int | None] = [None] * len(seqs)
            lengths = [0] * len(seqs)
            for j, i in enumerate(live):
                rows[i], lengths[i] = j, limits[i]
            return DeviceChains(logits.argmax(dim=-1), rows, lengths)
        values, tokens = torch.log_softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        values, tokens = values.cpu(), tokens.cpu()  # one host read
        for j, i in enumerate(live):
            depth = limits[i]
            if seqs[i].params.greedy:
                drafts[i] = draft_tree(values[j, :depth], tokens[j, :depth], self.max_nodes)
            else:  # sampled requests verify the linear draft
                drafts[i] = Draft.chain(tokens[j, :depth, 0].tolist())
        return drafts


def _require(tensors: dict, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"DFlash draft: checkpoint has no tensor {name!r}")
    if shape is not None and tuple(tensors[name].shape) != shape:
        raise ValueError(
            f"DFlash draft: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}"
        )
    return tensors[name]
