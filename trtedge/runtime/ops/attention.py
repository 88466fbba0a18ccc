"""Paged attention: the batch layout every backend reads, and the torch reference backend.

Tokens of all sequences in a step are flattened into one dimension, sequence after sequence:
sequence i owns the next ``query_lens[i]`` rows; its keys are the first ``context_lens[i]`` slots
named by its block table, the last ``query_lens[i]`` of which this step writes (``slot_mapping``).
A cache is in the model's dtype or, with ``--kv-cache-dtype fp8`` / ``int8``, in the layout of ``kv_fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtedge.runtime.ops import kv_fp8


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot for each new token
    query_lens: list[int]
    context_lens: list[int]  # keys visible to each sequence after this step
    block_tables: list[torch.Tensor]  # per sequence: int64 block ids covering context_lens[i]
    block_size: int
    # Device-side copies for kernels that must not read host lists (CUDA decode, graph replay):
    tables_tensor: torch.Tensor | None = None  # [num_seqs, max_blocks]
    context_lens_tensor: torch.Tensor | None = None  # [num_seqs]
    # Prefill and mixed steps on CUDA: (padded tables, tiles, seqs) for the Triton varlen kernel.
    prefill_plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Per sequence an explicit [query_len, context_len] bool mask (True = may attend), or None for
    # causal: token-tree verification, where a draft node sees the prefix and its ancestors only.
    masks: list[torch.Tensor | None] | None = None

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def padded_block_tables(self) -> torch.Tensor:
        """[num_seqs, max_blocks] int64 (rows padded with 0)."""
        return torch.nn.utils.rnn.pad_sequence(self.block_tables, batch_first=True)


class TorchAttention:
    """Reference backend: works on any device; the oracle the other backends are tested against.

    ``window`` > 0 limits each query to the ``window`` most recent keys, itself included (sliding-
    window layers); ``softcap`` squashes scores to (-softcap, softcap) with tanh before the softmax.
    """

    def __init__(self, scale: float, window: int = 0, softcap: float | None = None):
        self.scale = scale
        self.window = window
        self.softcap = softcap

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        kv_fp8.store(k_cache, batch.slot_mapping, k)
        kv_fp8.store(v_cache, batch.slot_mapping, v)
        if batch.tables_tensor is not None and not batch.block_tables:
            return self._decode_from_tables(q, k_cache, v_cache, batch)
        out = torch.empty_like(q)
        start = 0
        masks = batch.masks or [None] * len(batch.query_lens)
        for qlen, ctx, table, mask in zip(batch.query_lens, batch.context_lens, batch.block_tables, masks):
            end = start + qlen
            if qlen == ctx and mask is None and not kv_fp8.is_scaled(k_cache):
                keys, values = k[start:end], v[start:end]
            else:
                keys = kv_fp8.read(k_cache[table].flatten(0, 1)[:ctx], q.dtype)
                values = kv_fp8.read(v_cache[table].flatten(0, 1)[:ctx], q.dtype)
            out[start:end] = self._attend(q[start:end], keys, values, ctx - qlen, mask)
            start = end
        return out

    def _decode_from_tables(self, q, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """A decode step (one query row a sequence) given only the device's block tables and context
        lengths (a CUDA graph's static inputs): every row gathers its whole table and masks what lies
        past its context; nothing is read back to the host."""
        tables = batch.tables_tensor.long()
        rows, width = tables.shape
        keys = kv_fp8.read(k_cache[tables].flatten(1, 2), q.dtype)  # [rows, width * block_size, Hkv, D]
        values = kv_fp8.read(v_cache[tables].flatten(1, 2), q.dtype)
        place = torch.arange(keys.shape[1], device=q.device)
        context = batch.context_lens_tensor.long()[:, None]
        visible = place[None, :] < context
        if self.window:
            visible = visible & (place[None, :] >= context - self.window)
        qt, kt, vt = q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2)  # [rows, heads, ., D]
        mask = visible[:, None, None, :]
        if self.softcap is not None:
            group = qt.shape[1] // kt.shape[1]
            kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
            scores = torch.tanh((qt.float() @ kt.float().transpose(-1, -2)) * self.scale / self.softcap)
            scores = (scores * self.softcap).masked_fill(~mask, float("-inf"))
            return (scores.softmax(-1) @ vt.float()).to(q.dtype)[:, :, 0]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[:, :, 0]

    def _attend(self, q, k, v, offset: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        qlen, klen = q.shape[0], k.shape[0]
        if self.window and klen - self.window > 0 and qlen == 1 and mask is None:
            k, v, offset, klen = k[-self.window :], v[-self.window :], self.window - 1, self.window
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if mask is not None:
            causal = False
            if self.window:
                # a query's visible keys (the prefix, its ancestors, itself) sit at consecutive positions
                # up to its own: the window keeps the last ``window`` of them
                seen = mask.cumsum(dim=-1)
                mask = mask & (seen > seen[:, -1:] - self.window)
        elif self.window and klen > self.window:
            rows = torch.arange(qlen, device=q.device).unsqueeze(1) + offset
            cols = torch.arange(klen, device=q.device).unsqueeze(0)
            mask, causal = (cols <= rows) & (cols > rows - self.window), False
        elif qlen == 1:
            mask, causal = None, False
        elif offset == 0:
            mask, causal = None, True
        else:
            rows = torch.arange(qlen, device=q.device).unsqueeze(1) + offset
            mask, causal = torch.arange(klen, device=q.device).unsqueeze(0) <= rows, False
        if self.softcap is not None:
            return self._attend_softcapped(qt, kt, vt, mask, causal).transpose(0, 1)
        # on the CPU with a batch dimension: 3-D inputs take torch's math path there (the whole score matrix,
        # the keys repeated per query head), 4-D ones its flash kernel (measured 4-5x faster at 1,024
        # tokens, 32 heads on 8, D 64); CUDA (token trees) keeps 3-D, its kernel choice with 4-D not measured
        batched = q.device.type == "cpu"
        if batched:
            qt, kt, vt = qt[None], kt[None], vt[None]
        o = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
        )
        return (o[0] if batched else o).transpose(0, 1)

    def _attend_softcapped(self, qt, kt, vt, mask, causal: bool) -> torch.Tensor:
        group = qt.shape[0] // kt.shape[0]
        kt, vt = kt.repeat_interleave(group, 0), vt.repeat_interleave(group, 0)
        scores = (
            torch.tanh((qt.float() @ kt.float().transpose(1, 2)) * self.scale / self.softcap) * self.softcap
        )
        if causal:
            mask = torch.ones(qt.shape[1], kt.shape[1], dtype=torch.bool, device=qt.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ vt.float()).to(qt.dtype)


class CudaAttention(TorchAttention):
    """CUDA backend: decode steps run the Triton paged kernel (graph-capturable: no host reads);
    prefill and mixed steps run the Triton varlen kernel over the paged cache when the runner
    planned one, else the reference path."""

    def __call__(self, q, k, v, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        if batch.tables_tensor is None and batch.prefill_plan is None:
            return super().__call__(q, k, v, k_cache, v_cache, batch)
        from trtedge.runtime.ops.triton_attention import paged_decode_attention
        from trtedge.runtime.ops.triton_prefill import paged_prefill_attention

        kv_fp8.store(k_cache, batch.slot_mapping, k)
        kv_fp8.store(v_cache, batch.slot_mapping, v)
        if batch.tables_tensor is None:
            return paged_prefill_attention(
                q, k_cache, v_cache, *batch.prefill_plan, self.scale, self.window, self.softcap
            )
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            batch.tables_tensor,
            batch.context_lens_tensor,
            self.scale,
            window=self.window,
            softcap=self.softcap,
        )
