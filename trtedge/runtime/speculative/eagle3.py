"""EAGLE-3: a one-layer draft head fed with the target's low/mid/high hidden states.

Checkpoint layout (as published, ``architectures: ["LlamaForCausalLMEagle3"]``): ``fc.weight``
[hidden, 3 x target_hidden] fuses the three target hidden states; ``midlayer.*`` is one llama
decoder layer whose attention reads ``[input_layernorm(embed(token)), hidden_norm(hidden)]``
(2 x hidden wide); ``norm.weight``; ``lm_head.weight`` over ``draft_vocab_size`` tokens;
``d2t`` maps a draft token id ``d`` to the target id ``d + d2t[d]`` (``t2d`` is not needed);
``embed_tokens.weight`` is optional (the target's is shared).

Draft row ``p`` combines the target's hidden state at position ``p`` with token ``p + 1`` and
predicts token ``p + 2``; past the last real row the head feeds its own (pre-norm) outputs back.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.executor.sampler import to_device
from trtedge.runtime.models.config import RopeConfig
from trtedge.runtime.models.layers import rms_norm, rotate
from trtedge.runtime.models.rope import rope_tables
from trtedge.runtime.ops import triton_attention
from trtedge.runtime.ops.attention import AttentionBatch, CudaAttention, TorchAttention
from trtedge.runtime.ops.linear import embedding
from trtedge.runtime.speculative.draft_cache import DraftCache, Row, TargetHiddens, draft_chains, last_rows
from trtedge.runtime.speculative.head_files import read_head
from trtedge.runtime.speculative.head_graphs import HeadGraphSpec, capture_or_eager
from trtedge.runtime.speculative.tree import DeviceChains, Draft

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Head:
    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], target, max_positions: int = 8192):
        dtype, device = getattr(target, "act_dtype", target.dtype), target.device
        w = {
            k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()
        }
        self.hidden = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.num_heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.dtype, self.device = dtype, device
        layers = target.cfg.num_layers
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        self.aux_layers = tuple(ids) if ids else (2, layers // 2, layers - 3)
        if len(self.aux_layers) != 3 or not all(0 <= i <= layers for i in self.aux_layers):
            raise ValueError(
                f"EAGLE-3 head: aux hidden state layers {self.aux_layers} do not fit a {layers}-layer target"
            )
        m = "midlayer."
        self.fc = _require(w, "fc.weight")
        if self.fc.shape[1] != 3 * target.cfg.hidden_size:
            raise ValueError(
                f"EAGLE-3 head: fc.weight is {tuple(self.fc.shape)}, expected [*, 3 x "
                f"{target.cfg.hidden_size}] for this target"
            )
        self.qkv = torch.cat([_require(w, f"{m}self_attn.{p}_proj.weight") for p in "qkv"])
        self.o = _require(w, f"{m}self_attn.o_proj.weight")
        self.gate_up = torch.cat(
            [_require(w, f"{m}mlp.gate_proj.weight"), _require(w, f"{m}mlp.up_proj.weight")]
        )
        self.down = _require(w, f"{m}mlp.down_proj.weight")
        self.input_norm = _require(w, f"{m}input_layernorm.weight")
        self.hidden_norm = _require(w, f"{m}hidden_norm.weight")
        self.post_norm = _require(w, f"{m}post_attention_layernorm.weight")
        self.norm = _require(w, "norm.weight")
        self.lm_head = _require(w, "lm_head.weight")
        self.embed = w.get("embed_tokens.weight", target.embed)
        draft_vocab = self.lm_head.shape[0]
        d2t = w.get("d2t")
        if d2t is None:
            d2t = torch.zeros(draft_vocab, dtype=torch.long, device=device)
        self.draft_to_target = torch.arange(draft_vocab, device=device) + d2t.to(
            device=device, dtype=torch.long
        )
        theta = float(
            config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        )
        cos, sin = rope_tables(RopeConfig(theta=theta), self.head_dim, self.head_dim, max_positions)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        # the Triton decode kernel where the head's steps run in CUDA graphs (their batches carry the
        # tables tensor); any other batch takes the reference path
        cuda = self.device.type == "cuda" and triton_attention.available()
        self.attention = (CudaAttention if cuda else TorchAttention)(self.head_dim**-0.5)

    def forward(
        self, ids, hidden, positions, kv_cache, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: [T, 3 x target_hidden] target states (fused by ``fc``) or [T, hidden] head outputs.
        Returns (logits over the draft vocabulary, pre-norm hidden for the next draft step)."""
        if hidden.shape[-1] != self.hidden:
            hidden = F.linear(hidden, self.fc)
        t = ids.shape[0]
        x = torch.cat(
            [
                rms_norm(embedding(ids, self.embed), self.input_norm, self.eps),
                rms_norm(hidden, self.hidden_norm, self.eps),
            ],
            dim=-1,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv).split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        q = rotate(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = rotate(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        o = self.attention(q, k, v.view(t, self.num_kv_heads, self.head_dim), *kv_cache, attn)
        y = hidden + F.linear(o.reshape(t, q_size), self.o)
        gate, up = F.linear(rms_norm(y, self.post_norm, self.eps), self.gate_up).chunk(2, dim=-1)
        y = y + F.linear(F.silu(gate) * up, self.down)
        return F.linear(rms_norm(y, self.norm, self.eps), self.lm_head).float(), y


def load_eagle3(path: str | Path, target, max_positions: int = 8192) -> Eagle3Head:
    """Load an EAGLE-3 head from a directory (config.json + safetensors) for ``target``."""
    config, tensors = read_head(path, "EAGLE-3 head", ARCHITECTURES)
    return Eagle3Head(config, tensors, target, max_positions)


class Eagle3Proposer:
    def __init__(
        self,
        head: Eagle3Head,
        target,
        config,
        num_blocks: int,
        block_size: int,
        graphs: HeadGraphSpec | None = None,
    ):
        """``graphs``: linear chains (``draft_top_k`` 1) in CUDA graphs (``head_graphs``) of that
        geometry, else eagerly."""
        if head is None:
            raise ValueError("--speculative-config method eagle3 needs model (no EAGLE-3 head was loaded)")
        self.head = head
        self.top_k = config.draft_top_k
        self.max_nodes = config.verify_tokens
        self.target_vocab = target.cfg.vocab_size
        # chains are drafted on the device where every draft token maps into the target's vocabulary
        # (a tree drops the children that do not)
        self.device_chains = self.top_k == 1 and bool((head.draft_to_target < self.target_vocab).all())
        target.aux_layers = head.aux_layers  # the target keeps these layers' inputs from every forward
        graphs = graphs if self.device_chains else None
        self.cache = DraftCache(
            1,
            head.num_kv_heads,
            head.head_dim,
            num_blocks,
            block_size,
            head.dtype,
            head.device,
            scratch=graphs is not None,
        )
        self.kv = self.cache.kv_caches[0]
        self.hiddens = TargetHiddens(self.cache, 3 * target.cfg.hidden_size, head.dtype, head.device)
        self.graphs = None
        if graphs is not None:
            width = 3 * target.cfg.hidden_size
            self.graphs = capture_or_eager(
                "eagle3", lambda: graphs.build(self._step, self.cache, width, head.hidden)
            )

    # ---- target hidden states ------------------------------------------------------------------
    def observe(self, seqs: list[Sequence], num_tokens: list[int], aux: torch.Tensor | None) -> None:
        self.hiddens.observe(seqs, num_tokens, aux)

    def verified(self, seq: Sequence, draft: Draft, path: list[int], aux) -> None:
        self.hiddens.verified(seq, path, aux)

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> DeviceChains | list[Draft | None]:
        rows, hiddens, live = [], [], []
        for i, (seq, depth) in enumerate(zip(seqs, limits)):
            st = self.cache.state(seq)
            n = seq.num_tokens
            start = min(st.num_computed_tokens, n - 2)
            scratch = depth * self.top_k
            if start < 0 or not self.cache.reserve(st, n - 1 + scratch):
                continue
            rows.append(Row(st, seq.token_ids[start + 1 : n], list(range(start, n - 1)), start))
            hiddens.append(self.hiddens.take(st, start, n - 1))
            live.append(i)
        if not rows:
            return [None] * len(seqs)
        depths = [min(limits[i], self.max_nodes) for i in live]
        if self.graphs is not None and self.graphs.takes(rows, depths):
            for row, i in zip(rows, live):
                row.state.num_computed_tokens = seqs[i].num_tokens - 1
            seq_ids = [seqs[i].seq_id for i in live]
            return self.graphs.propose(rows, hiddens, seq_ids, depths, live, len(seqs))
        ids, positions, attn = self.cache.attention_batch(rows)
        logits, out = self.head.forward(ids, torch.cat(hiddens), positions, self.kv, attn)
        last = to_device(last_rows(rows), torch.long, logits.device)
        logits, out = logits.index_select(0, last), out.index_select(0, last)
        if self.device_chains:
            return self._chains(seqs, depths, rows, live, logits, out)
        trees = {}
        for j, (row, i) in enumerate(zip(rows, live)):
            row.state.num_computed_tokens = seqs[i].num_tokens - 1
            trees[i] = _Tree(seqs[i].num_tokens - 1, row.state)
            trees[i].grow(None, out[j], logits[j], self)
        for _ in range(1, max(limits[i] for i in live)):
            batch_rows, frontier = [], []
            for i in live:
                tree = trees[i]
                if tree.depth >= limits[i]:
                    continue
                nodes = tree.frontier(self.top_k)
                if nodes:
                    batch_rows.append(tree.expansion_row(nodes))
                    frontier.append((tree, nodes))
            if not batch_rows:
                break
            ids, positions, attn = self.cache.attention_batch(batch_rows)
            parents = torch.stack([tree.parent_hidden(n) for tree, nodes in frontier for n in nodes])
            logits, out = self.head.forward(ids, parents, positions, self.kv, attn)
            k = 0
            for tree, nodes in frontier:
                for node in nodes:
                    tree.grow(node, out[k], logits[k], self)
                    k += 1
        drafts: list[Draft | None] = [None] * len(seqs)
        for i in live:
            drafts[i] = trees[i].select(self.max_nodes)
        return drafts

    def _best(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's best token (as ``top_children`` ranks them), as a target id."""
        return self.head.draft_to_target[torch.log_softmax(logits, dim=-1).topk(1).indices[:, 0]]

    def _step(self, tokens, hidden, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self.head.forward(tokens, hidden, positions, self.kv, attn)
        return self._best(logits), hidden

    def _chains(self, seqs, depths, rows: list[Row], live: list[int], logits, out) -> DeviceChains:
        """Linear drafts (``draft_top_k`` 1) on the device: each step's best token is the next step's
        input, never read by the host here."""
        for row, i in zip(rows, live):
            row.state.num_computed_tokens = seqs[i].num_tokens - 1
        ends = [seqs[i].num_tokens - 1 for i in live]
        states = [row.state for row in rows]
        return draft_chains(
            self._step, self.cache, states, ends, depths, live, len(seqs), self._best(logits), out
        )

    def top_children(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        logp = torch.log_softmax(logits, dim=-1)
        values, draft_ids = logp.topk(min(self.top_k, logp.shape[-1]))
        tokens = self.head.draft_to_target[draft_ids].tolist()
        return tokens, values.tolist()


class _Tree:
    """Candidates drafted for one sequence: node 0 is the root (its last real token)."""

    def __init__(self, root_position: int, state):
        self.root_position = root_position
        self.state = state
        self.tokens = [-1]
        self.parents = [-1]
        self.scores = [0.0]
        self.depths = [0]
        self.out: list[torch.Tensor | None] = [None]  # head output of a node's own row: its children's input
        self.storage: list[int | None] = [None]  # scratch KV slot of an expanded node
        self.level: list[int] = []
        self.depth = 0

    def grow(self, node: int | None, out: torch.Tensor, logits: torch.Tensor, proposer) -> None:
        parent = 0 if node is None else node
        self.out[parent] = out
        tokens, scores = proposer.top_children(logits)
        for token, score in zip(tokens, scores):
            if token >= proposer.target_vocab:
                continue
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(self.scores[parent] + score)
            self.depths.append(self.depths[parent] + 1)
            self.out.append(None)
            self.storage.append(None)
        self.depth = max(self.depths)

    def frontier(self, top_k: int) -> list[int]:
        deepest = [
            n for n in range(1, len(self.tokens)) if self.depths[n] == self.depth and self.storage[n] is None
        ]
        return sorted(deepest, key=lambda n: -self.scores[n])[:top_k]

    def parent_hidden(self, node: int) -> torch.Tensor:
        return self.out[self.parents[node]]

    def expansion_row(self, nodes: list[int]) -> Row:
        real = self.root_position  # real rows 0 .. root_position - 1
        used = sum(s is not None for s in self.storage)
        for k, node in enumerate(nodes):
            self.storage[node] = real + used + k
        width = real + used + len(nodes)
        mask = torch.zeros(len(nodes), width, dtype=torch.bool)
        mask[:, :real] = True
        for k, node in enumerate(nodes):
            n = node
            while n > 0:
                mask[k, self.storage[n]] = True
                n = self.parents[n]
        positions = [self.root_position - 1 + self.depths[n] for n in nodes]
        return Row(
            self.state, [self.tokens[n] for n in nodes], positions, real + used, mask.to(self.out[0].device)
        )

    def select(self, max_nodes: int) -> Draft | None:
        order = sorted(range(1, len(self.tokens)), key=lambda n: (-self.scores[n], self.depths[n], n))
        chosen: set[int] = set()
        for n in order:
            if len(chosen) == max_nodes:
                break
            if self.parents[n] == 0 or self.parents[n] in chosen:
                chosen.add(n)
        if not chosen:
            return None
        nodes = sorted(chosen, key=lambda n: (self.depths[n], n))
        index = {0: 0} | {n: j + 1 for j, n in enumerate(nodes)}
        return Draft([self.tokens[n] for n in nodes], [index[self.parents[n]] for n in nodes])


def _require(tensors: dict, name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"EAGLE-3 head: checkpoint has no tensor {name!r}")
    return tensors[name]
