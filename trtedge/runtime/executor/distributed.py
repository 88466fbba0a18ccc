"""Tensor parallelism: which slice of each weight a rank holds, and the layers that join the slices.

Megatron's split of a llama-family decoder over N ranks: q/k/v and gate/up are column-parallel (each
rank holds 1/N of the heads and of the intermediate size), o_proj and down_proj row-parallel (an
all-reduce after them), the embedding and lm_head vocab-parallel (an all-reduce after the embedding,
an all-gather of the logits). A rank's model is the ordinary model built from its slices with a
config whose head counts and intermediate size are divided by N; the KV cache it allocates from that
config holds only its own KV heads. Communication goes through torch.distributed only.

Mixture-of-experts layers shard every expert's products the same way (gate/up by rows, down by
columns: 1/N of each expert's intermediate size on every rank) rather than placing whole experts on
ranks: every rank routes all tokens alike (the router is replicated), the grouped kernel runs
unchanged on narrower experts, the work stays balanced whatever the routing, and the layer needs one
all-reduce (after the routed and shared experts' sum), as a dense MLP does; expert placement would
need a token exchange in and out of every layer and leaves ranks idle when routing is skewed.

Qwen3.5's Gated DeltaNet layers split by heads like attention: each rank holds 1/N of the key heads
and of the value heads (a key head's value heads stay on its rank), so its slices of the qkv, z, b
and a projections, of the short convolution's channels, of A_log and dt_bias, and its recurrent
state rows are those heads' only; out_proj is row-parallel. The state pool of a rank holds its heads'
states; rank 0's operations on the pool outside a forward (zeroing a fresh sequence, snapshot
copies, rollbacks) are replayed on the other ranks with the next step (see ``tp_plan``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.distributed as dist

from trtedge.runtime.artifacts.quantize import GROUP, QuantizedTensor, pack_int4, unpack_int4
from trtedge.runtime.models.config import ModelConfig
from trtedge.runtime.models.layers import GatedMLP
from trtedge.runtime.models.qwen3_5 import GatedDeltaNet, Qwen35Layer

# The families whose layers are all covered by the split below.
TP_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen2_moe", "qwen3_moe", "mixtral",
    "qwen3_5", "qwen3_5_moe", "qwen3_next",
)  # fmt: skip
_LAYER = re.compile(r"model\.(?:language_model\.)?layers\.\d+\.(.+)")
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
# one expert's (or the shared expert's) products: gate/up split by rows, down by columns
_EXPERT = r"(mlp|block_sparse_moe)\.(experts\.\d+|shared_expert)\."
_EXPERT_COLUMN = re.compile(_EXPERT + r"(gate_proj|up_proj|w1|w3)")
_EXPERT_ROW = re.compile(_EXPERT + r"(down_proj|w2)")
# transformers 5's stacked experts: gate_up [E, 2I, H], down [E, H, I] (with or without ".weight")
_STACKED = re.compile(r"(mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)(\.weight)?")
_VOCAB = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "lm_head.weight")
# Gated DeltaNet: split by heads (rows), out_proj by columns; the per-head-dim norm on every rank
# (Qwen3-Next's fused in_proj_qkvz / in_proj_ba are grouped by key head: a rank's key heads are rows too)
_LINEAR_HEAD_ROWS = ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                     "linear_attn.in_proj_a.weight", "linear_attn.A_log", "linear_attn.dt_bias",
                     "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")  # fmt: skip
_LINEAR_MIXED = ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")  # q, k, v channels


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, or the model cannot be split as asked."""


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming --tensor-parallel-size when ``cfg`` cannot be split over ``size`` ranks."""
    if size == 1:
        return
    if cfg.model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {size}: the {cfg.model_type} family does not "
            f"support tensor parallelism yet (supported: {', '.join(TP_MODEL_TYPES)}); use 1"
        )
    if cfg.vision is not None or cfg.audio is not None:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {size}: tensor parallelism serves text "
            "models only (this checkpoint has a vision or audio encoder); use 1"
        )
    lin = cfg.linear
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {size} neither divides the model's "
            f"{cfg.num_kv_heads} KV heads (num_key_value_heads) nor is a multiple of them; choose a size "
            f"that divides {cfg.num_heads} attention heads and divides or is a multiple of "
            f"{cfg.num_kv_heads} KV heads"
        )
    for what, count in (
        ("attention heads", cfg.num_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size),
        ("linear_num_key_heads", lin.num_key_heads if lin is not None else 0),
        ("linear_num_value_heads", lin.num_value_heads if lin is not None else 0),
    ):
        if count % size:
            raise ValueError(
                f"tensor_parallel_size (--tensor-parallel-size) {size} does not divide the model's {count} "
                f"{what}; choose a size that divides {cfg.num_heads} attention heads and "
                f"{cfg.num_kv_heads} KV heads"
            )


def check_quantized_split(cfg: ModelConfig, size: int, weights: str) -> None:
    """int4 keeps a scale per group of 32 inputs: a row-parallel layer whose inputs are int4 (a multiple
    of 32) must give each rank whole groups. Raise ``ValueError`` naming the flag before any rank starts."""
    if weights != "int4" or size == 1:
        return
    for what, width in (
        ("attention width (heads x head_dim)", cfg.num_heads * cfg.head_dim),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if width % GROUP == 0 and (width // size) % GROUP:
            raise ValueError(
                f"tensor_parallel_size (--tensor-parallel-size) {size} with --weights int4: each rank's "
                f"{width // size} of the model's {width} {what} would cut int4's groups of {GROUP}; use "
                "a smaller size or --weights int8"
            )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank builds its model from: 1/size of the heads and of the MLP (and each
    expert's) width."""
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),  # fewer KV heads than ranks: one each, replicated
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size,
        linear=None
        if cfg.linear is None
        else replace(
            cfg.linear,
            num_key_heads=cfg.linear.num_key_heads // size,
            num_value_heads=cfg.linear.num_value_heads // size,
        ),
    )


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows per rank) of the vocabulary slice; the last slice is zero-padded to the same size."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


def _shape(view) -> list[int]:
    return list(view.get_shape()) if hasattr(view, "get_shape") else list(view.shape)


def _rows(view, parts: list[int], rank: int, size: int) -> torch.Tensor:
    """Rank's 1/size of each consecutive block of ``parts`` rows, concatenated (a fused qkv / gate_up)."""
    out, start = [], 0
    for n in parts:
        step = n // size
        out.append(view[start + rank * step : start + (rank + 1) * step])
        start += n
    return _cat(out)


def _cat(parts: list):
    if len(parts) == 1:
        return parts[0]
    return QuantizedTensor.cat(parts) if isinstance(parts[0], QuantizedTensor) else torch.cat(parts)


def _kv_rows(view, start: int, cfg: ModelConfig, rank: int, size: int):
    """Rank's rows of a k or v projection that begins at row ``start``: 1/size of the KV heads or,
    with fewer KV heads than ranks, the one KV head its query heads read (replicated on
    size / num_kv_heads ranks)."""
    if cfg.num_kv_heads >= size:
        step = cfg.num_kv_heads * cfg.head_dim // size
        return view[start + rank * step : start + (rank + 1) * step]
    head = rank * cfg.num_kv_heads // size
    return view[start + head * cfg.head_dim : start + (head + 1) * cfg.head_dim]


class _QuantizedView:
    """A quantized weight sliced as a tensor is: by rows (with their scales), or by input columns.
    The values and scales are the whole weight's, never requantized, so a rank's partial product is
    exactly its share of one device's."""

    def __init__(self, q: QuantizedTensor):
        self.q = q
        self.shape = q.shape

    def __getitem__(self, key) -> QuantizedTensor:
        q = self.q
        if not isinstance(key, tuple):
            return q.select_rows(key) if not isinstance(key, slice) else q.row_slice(key.start, key.stop)
        start, stop = key[1].start, key[1].stop
        if q.format == "int8":  # one scale per row: every rank's columns keep it
            return QuantizedTensor("int8", q.data[:, start:stop].contiguous(), q.scale)
        if q.format == "int4" and start % GROUP == 0 and stop % GROUP == 0:
            groups = slice(start // GROUP, stop // GROUP)
            values = pack_int4(unpack_int4(q.data)[:, start:stop])
            return QuantizedTensor(
                "int4", values, q.scale[:, groups].contiguous(), q.min[:, groups].contiguous()
            )
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size): a rank's {stop - start} input columns of an "
            f"{q.format} weight do not split its groups of {GROUP}; use int8 weights or another size"
        )


def _pad_rows(part, rows: int):
    """``part`` with zero rows appended up to ``rows`` (a quantized zero row dequantizes to zeros)."""
    missing = rows - part.shape[0]
    if missing <= 0:
        return part
    if isinstance(part, QuantizedTensor):
        pad = [None if t is None else torch.cat([t, t.new_zeros(missing, *t.shape[1:])]) for t in
               (part.data, part.scale, part.min)]  # fmt: skip
        return QuantizedTensor(part.format, *pad)
    return torch.cat([part, part.new_zeros(missing, *part.shape[1:])])


def shard_tensor(name: str, view, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """Rank's slice of the HF-named tensor; ``view`` is a tensor, a safetensors slice (read lazily)
    or a ``QuantizedTensor`` (sliced with its scales)."""
    if isinstance(view, QuantizedTensor):
        view = _QuantizedView(view)
    shape = _shape(view)
    if name in _VOCAB:
        start, rows = vocab_shard(shape[0], rank, size)
        return _pad_rows(view[start : min(start + rows, shape[0])], rows)
    m = _LAYER.fullmatch(name)
    if m is None:
        return view[:]
    inner = m.group(1)
    local, _, suffix = inner.rpartition(".")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if inner in _LINEAR_HEAD_ROWS:
        return _rows(view, [shape[0]], rank, size)
    if inner in _LINEAR_MIXED:
        lin = cfg.linear
        key, value = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
        return _rows(view, [key, key, value], rank, size)
    if inner == "linear_attn.out_proj.weight":
        step = shape[1] // size
        return view[:, rank * step : (rank + 1) * step]
    stacked = _STACKED.fullmatch(m.group(1))
    if stacked is not None:
        if stacked.group(2) == "down_proj":  # [E, H, I]: each expert's input columns
            step = shape[2] // size
            return view[:, :, rank * step : (rank + 1) * step]
        half = shape[1] // 2  # [E, 2I, H]: each expert's gate rows, then its up rows
        step = half // size
        gate = view[:, rank * step : (rank + 1) * step]
        return torch.cat([gate, view[:, half + rank * step : half + (rank + 1) * step]], dim=1)
    if _EXPERT_COLUMN.fullmatch(local):
        return _rows(view, [shape[0]], rank, size)
    if _EXPERT_ROW.fullmatch(local):
        step = shape[1] // size
        return view[:, rank * step : (rank + 1) * step]
    if local in ("self_attn.k_proj", "self_attn.v_proj"):
        return _kv_rows(view, 0, cfg, rank, size)
    if local in _COLUMN:
        return _rows(view, [shape[0]], rank, size)
    if local == "self_attn.qkv_proj":
        return _cat([_rows(view, [q], rank, size), _kv_rows(view, q, cfg, rank, size),
                     _kv_rows(view, q + kv, cfg, rank, size)])  # fmt: skip
    if local == "mlp.gate_up_proj":
        return _rows(view, [shape[0] // 2] * 2, rank, size)
    if local in _ROW:
        if suffix == "bias":  # added once, after the all-reduce
            t = view[:]
            return t if rank == 0 else torch.zeros_like(t)
        step = shape[1] // size
        return view[:, rank * step : (rank + 1) * step]
    return view[:]  # norms: every rank holds all of them


class RowParallel:
    """A row-parallel linear layer: the rank's partial product, summed over the ranks."""

    def __init__(self, linear, group=None):
        self.linear = linear
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()
        dist.all_reduce(y, group=self.group)
        return y

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes


class ReducedMLP:
    """An MLP block whose output is a partial sum on each rank (a MoE layer: its routed experts plus
    the gated shared expert, all row-parallel), summed over the ranks once."""

    def __init__(self, mlp, group=None):
        self.mlp = mlp
        self.group = group

    def __call__(self, h: torch.Tensor, kernels=None) -> torch.Tensor:
        y = self.mlp(h, kernels).contiguous()
        dist.all_reduce(y, group=self.group)
        return y

    @property
    def linears(self) -> list:
        return self.mlp.linears


class VocabParallelEmbedding:
    """Each rank looks up the ids in its vocabulary slice (zeros elsewhere); the all-reduce joins them.
    ``lookup`` is the model's own embedding of ids into its slice (Gemma scales it)."""

    def __init__(self, lookup, rows: int, start: int, group=None):
        self.lookup = lookup
        self.rows = rows
        self.start = start
        self.group = group

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self.lookup(local.masked_fill(outside, 0)).contiguous()
        x.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(x, group=self.group)
        return x


class GatheredHead:
    """A vocab-parallel lm_head: every rank computes its slice of the logits and gets them all in one
    all-gather (only rank 0 samples). An all-gather, not a gather to rank 0: NCCL runs a gather as
    point-to-point sends, which a decode CUDA graph cannot capture."""

    def __init__(self, linear, vocab_size: int, rank: int, size: int, group=None):
        self.linear = linear
        self.vocab_size = vocab_size
        self.rank = rank
        self.size = size
        self.group = group

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        part = self.linear(hidden).contiguous()
        rows = part.shape[0]
        out = part.new_empty(self.size * rows, part.shape[1])  # the ranks' slices, one after another
        _all_gather(out, part, group=self.group)
        return out.view(self.size, rows, -1).permute(1, 0, 2).reshape(rows, -1)[:, : self.vocab_size]

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes


# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _join_mlp(mlp, group):
    if isinstance(mlp, GatedMLP):
        mlp.down = RowParallel(mlp.down, group)
        return mlp
    return ReducedMLP(mlp, group)


def parallelize(model, rank: int, size: int, vocab_size: int, group=None) -> None:
    """Join a rank's model built from its slices: all-reduce after o_proj and down_proj (after a MoE
    block's sum), the vocab-parallel embedding, the logits all-gathered."""
    for layer in model.layers:
        if isinstance(layer, Qwen35Layer):
            mixer = layer.mixer
            if isinstance(mixer, GatedDeltaNet):
                mixer.out_proj = RowParallel(mixer.out_proj, group)
            else:
                mixer.o = RowParallel(mixer.o, group)
            layer.ffn = _join_mlp(layer.ffn, group)
        else:
            layer.o = RowParallel(layer.o, group)
            layer.mlp = _join_mlp(layer.mlp, group)
    start, rows = vocab_shard(vocab_size, rank, size)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, rows, start, group)
    model.lm_head = GatheredHead(model.lm_head, vocab_size, rank, size, group)
    # Paths that would skip the collectives: the one-call native decode step (int8/int4 on the CPU)
    # and the CUDA products that fold the residual add into o_proj / down_proj.
    model.native_step = None
    model.fused_products = False
