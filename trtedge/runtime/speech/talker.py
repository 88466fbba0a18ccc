"""Qwen3-Omni's Talker and code predictor: the Talker (a small MoE decoder) reads the conversation
projected from the thinker's width and emits the first codebook's token of each codec frame; the code
predictor (a small dense decoder, a fresh sequence per frame) fills the other ``num_code_groups - 1``
codebooks from the Talker's last hidden state. The next Talker input is the sum of the frame's code
embeddings plus the next text token's projection (``tts_pad`` once the text is spent)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtedge.runtime.models.layers import ACTIVATIONS, require
from trtedge.runtime.speech.config import SpeechConfig
from trtedge.runtime.speech.layers import Decoder, KVCache, sub


@dataclass(frozen=True)
class TalkerSampling:
    """How the Talker picks each frame's first code (the reference's defaults); the code predictor
    samples with top_k 50 / top_p 0.8 when the Talker samples, greedily when it does not."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    max_frames: int = 4096
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ResizeMLP:
    def __init__(self, w: dict, act: str):
        self.fc1 = (require(w, "linear_fc1.weight"), w.get("linear_fc1.bias"))
        self.fc2 = (require(w, "linear_fc2.weight"), w.get("linear_fc2.bias"))
        self.act = ACTIVATIONS[act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, *self.fc1)), *self.fc2)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen) -> int:
    """One id from (vocab,) float32 logits: greedy at temperature 0, else temperature, top-k, top-p."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(logits, descending=False)
        cum = torch.softmax(logits[order], -1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


class TalkerRun:
    """One speech's Talker state on the device: its KV cache, the last hidden state, the codes so far.
    ``frame()`` makes the next frame (None: the speech has ended), ``advance(row)`` feeds the Talker
    that frame with the next text row (None once the text is spent: ``tts_pad``)."""

    def __init__(self, talker: Talker, prefill: torch.Tensor, pad: torch.Tensor, params: TalkerSampling):
        self.talker, self.pad, self.params = talker, pad, params
        self.gen = None
        if not params.greedy:
            self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        self.cache = KVCache(talker.cfg.talker.num_layers)
        with torch.inference_mode():
            self.hidden = talker.model(prefill.to(talker.dtype), self.cache)[-1]
        self.history: list[int] = []
        self.embeds: torch.Tensor | None = None
        self.num_frames = 0

    @torch.inference_mode()
    def frame(self) -> list[int] | None:
        t, params = self.talker, self.params
        logits = F.linear(self.hidden, t.codec_head).float()
        if params.repetition_penalty != 1.0 and self.history:
            seen = torch.tensor(sorted(set(self.history)), device=logits.device)
            got = logits[seen]
            logits[seen] = torch.where(
                got < 0, got * params.repetition_penalty, got / params.repetition_penalty
            )
        logits[t.suppressed] = float("-inf")
        code = sample(logits, params.temperature, params.top_k, params.top_p, self.gen)
        if code == t.cfg.codec_ids["eos"] or self.num_frames == params.max_frames:
            return None
        self.history.append(code)
        residual, self.embeds = t._residual(self.hidden, code, params.greedy, self.gen)
        self.num_frames += 1
        return [code, *residual]

    @torch.inference_mode()
    def advance(self, row: torch.Tensor | None) -> None:
        x = self.embeds + (self.pad if row is None else row).to(self.talker.dtype)
        self.hidden = self.talker.model(x[None], self.cache)[-1]


class Talker:
    def __init__(self, cfg: SpeechConfig, tensors: dict[str, torch.Tensor], dtype, device):
        """``tensors``: the checkpoint's ``talker.*`` tensors (code predictor included), names without
        the ``talker.`` prefix."""
        self.cfg = cfg
        self.dtype, self.device = dtype, device
        w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self.model = Decoder(cfg.talker, sub(w, "model."), device, qk_norm=True, moe=True)
        self.codec_embedding = require(w, "model.codec_embedding.weight")
        self.codec_head = require(w, "codec_head.weight")
        act = cfg.talker.hidden_act
        self.text_projection = ResizeMLP(sub(w, "text_projection."), act)
        self.hidden_projection = ResizeMLP(sub(w, "hidden_projection."), act)
        cp = sub(w, "code_predictor.")
        self.predictor = Decoder(cfg.code_predictor, sub(cp, "model."), device, qk_norm=True)
        groups = cfg.num_code_groups - 1
        self.predictor_embeddings = [require(cp, f"model.codec_embedding.{i}.weight") for i in range(groups)]
        self.predictor_heads = [require(cp, f"lm_head.{i}.weight") for i in range(groups)]
        v = cfg.talker.vocab_size
        # the codec's special tokens past the codebook are never sampled, except the end of speech
        self.suppressed = torch.tensor(
            [i for i in range(max(v - 1024, 0), v) if i != cfg.codec_ids["eos"]], device=device
        )

    @property
    def weight_bytes(self) -> int:
        return 0  # reported by the pipeline from its tensors

    def embed_codes(self, ids: list[int]) -> torch.Tensor:
        return self.codec_embedding[torch.tensor(ids, device=self.device)]

    def frames(
        self, prefill: torch.Tensor, trailing: torch.Tensor, pad: torch.Tensor, params
    ) -> Iterator[list[int]]:
        """Codec frames (``num_code_groups`` codes each) until the Talker ends the speech or
        ``params.max_frames``: ``prefill`` (positions, hidden) Talker inputs, ``trailing`` the text
        rows still to speak, one a step, then ``pad``. (The engine runs a ``TalkerRun`` a step at a
        time instead, as a speech sequence.)"""
        run = TalkerRun(self, prefill, pad, params)
        while (frame := run.frame()) is not None:
            yield frame
            run.advance(trailing[run.num_frames - 1] if run.num_frames <= trailing.shape[0] else None)

    def _residual(self, hidden: torch.Tensor, code: int, greedy: bool, gen) -> tuple[list[int], torch.Tensor]:
        """The other codebooks' codes of a frame and the sum of all its code embeddings."""
        first = self.codec_embedding[code]
        cache = KVCache(self.cfg.code_predictor.num_layers)
        h = self.predictor(torch.stack([hidden, first]), cache)[-1]
        codes, total = [], first.clone()
        for i, head in enumerate(self.predictor_heads):
            logits = F.linear(h, head).float()
            c = sample(logits, 0.0 if greedy else 1.0, 50, 0.8, gen)
            codes.append(c)
            e = self.predictor_embeddings[i][c]
            total = total + e
            if i + 1 < len(self.predictor_heads):
                h = self.predictor(e[None], cache)[-1]
        return codes, total
