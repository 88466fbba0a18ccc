"""What a step's forward needs for sequences with media: M-RoPE positions of their prompt tokens (models
with M-RoPE), and the encoder embeddings that replace the placeholder tokens' embeddings.

Each media item is encoded once per request, when the first chunk holding any of its tokens is
prefilled (all items missing in a step go through the encoder together, across requests), and kept
on the sequence until its prompt is fully in the KV cache; a chunk boundary may cut an item, the
next chunk takes the rest. Repeated items come from an LRU cache keyed by content hash.
"""

from __future__ import annotations

import torch

from trtedge.runtime.multimodal.cache import EmbeddingCache


class MediaInputs:
    """The media encoders (vision for images and videos, audio for clips) and their embedding cache
    (engine thread only)."""

    def __init__(self, encoder, cache_bytes: int, audio_encoder=None):
        self.encoder = encoder
        self.audio_encoder = audio_encoder
        self.cache = EmbeddingCache(cache_bytes)
        self.num_encoded = 0  # items run through the encoder

    def metrics(self) -> dict:
        cache = self.cache
        return {
            "hits": cache.stats.hits,
            "misses": cache.stats.misses,
            "evictions": cache.stats.evictions,
            "entries": len(cache),
            "bytes": cache.bytes,
            "max_bytes": cache.max_bytes,
            "encoded_items": self.num_encoded,
        }

    def encode(self, items: list) -> list[torch.Tensor]:
        """Embeddings of each item: from the cache, else one encoder pass for all the others."""
        out: list[torch.Tensor | None] = [self.cache.get(it.hash) for it in items]
        todo: dict[bytes, list[int]] = {}
        for i, (it, emb) in enumerate(zip(items, out)):
            if emb is None:
                todo.setdefault(it.hash, []).append(i)
        for audio in (False, True):
            group = {h: idx for h, idx in todo.items() if (items[idx[0]].kind == "audio") == audio}
            if not group:
                continue
            encoder = self.audio_encoder if audio else self.encoder
            if encoder is None:
                kind = "audio" if audio else "vision"
                raise ValueError(f"this model has no {kind} component: the request's media cannot be encoded")
            firsts = [items[idx[0]] for idx in group.values()]
            pixels = torch.cat([it.pixels for it in firsts])
            result = encoder(pixels, [it.grid for it in firsts])
            self.num_encoded += len(firsts)
            for it, emb, idx in zip(firsts, result.split([it.num_tokens for it in firsts]), group.values()):
                self.cache.put(it.hash, emb)
                for i in idx:
                    out[i] = emb
        return out


def encode_batch_media(media: MediaInputs, batch) -> list[tuple]:
    """Encode the items the batch's prompt rows reach and are not encoded yet (all in one pass). When
    that fails, each sequence's items are tried alone: returns (sequence, error) for those whose own
    media cannot be encoded, so that one bad item fails its request, not the whole step."""
    needed = []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        if seq.mm is None or start >= seq.num_prompt_tokens:
            continue
        for i, item in enumerate(seq.mm.items):
            if item.offset < start + n and item.end > start and i not in seq.mm_embeds:
                needed.append((seq, i, item))
    if not needed:
        return []
    try:
        _encode_into(media, needed)
        return []
    except Exception:
        pass
    failed = []
    for seq in dict.fromkeys(s for s, _, _ in needed):
        try:
            _encode_into(media, [row for row in needed if row[0] is seq])
        except Exception as e:
            failed.append((seq, e))
    return failed


def _encode_into(media: MediaInputs, needed: list[tuple]) -> None:
    for (seq, i, _), emb in zip(needed, media.encode([it for _, _, it in needed])):
        seq.mm_embeds[i] = emb


def media_inputs(media: MediaInputs | None, batch, positions: list[int], device) -> tuple:
    """(positions, embeds) for the runner: (3, T) positions when some row computes prompt tokens of a
    multimodal sequence with M-RoPE positions (else the 1D list unchanged), and (rows, values) of media
    embeddings or None."""
    rows = []  # (seq, start, end, first row of the sequence in the flattened batch)
    row = 0
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        if seq.mm is not None and start < seq.num_prompt_tokens:
            rows.append((seq, start, start + n, row))
        row += n
    if not rows:
        return positions, None
    if media is None:
        raise ValueError("this model has no media encoder: the request's media cannot be encoded")
    failed = encode_batch_media(media, batch)
    if failed:
        raise failed[0][1]
    pos = positions
    if any(seq.mm.positions is not None for seq, *_ in rows):
        pos = torch.tensor(positions, dtype=torch.long).expand(3, -1).clone()
        for seq, start, end, first in rows:
            stop = min(end, seq.num_prompt_tokens)
            pos[:, first : first + stop - start] = seq.mm.positions[:, start:stop]
    index, values = [], []
    for seq, start, end, first in rows:
        for i, item in enumerate(seq.mm.items):
            a, b = max(start, item.offset), min(end, item.end)
            if a < b:
                index.append(torch.arange(first + a - start, first + b - start))
                values.append(seq.mm_embeds[i][a - item.offset : b - item.offset])
    if not index:
        return pos, None
    return pos, (torch.cat(index).to(device), torch.cat(values).to(device))
