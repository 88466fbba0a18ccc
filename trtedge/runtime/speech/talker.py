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


class FixedText:
    """Text rows known in full."""

    cancelled = False

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def get(self, step: int) -> torch.Tensor | None:
        return self.rows[step] if step < self.rows.shape[0] else None


class TextFeed:
    """Text rows that arrive while the Talker speaks (the thinker still generating): ``get(step)``
    waits until row ``step`` is there or the text is complete (then None: the Talker pads). The
    Talker reads the same rows at the same steps as with the whole text, so its frames are the same."""

    def __init__(self):
        import threading

        self._rows: list[torch.Tensor] = []
        self._done = False
        self.cancelled = False
        self._cond = threading.Condition()

    def append(self, rows: torch.Tensor) -> None:
        with self._cond:
            self._rows.extend(rows)
            self._cond.notify_all()

    def finish(self, cancelled: bool = False) -> None:
        with self._cond:
            self._done = True
            self.cancelled = self.cancelled or cancelled
            self._cond.notify_all()

    def get(self, step: int) -> torch.Tensor | None:
        with self._cond:
            self._cond.wait_for(lambda: step < len(self._rows) or self._done)
            return self._rows[step] if step < len(self._rows) else None


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

    @torch.inference_mode()
    def frames(
        self, prefill: torch.Tensor, trailing, pad: torch.Tensor, params: TalkerSampling
    ) -> Iterator[list[int]]:
        """Codec frames (``num_code_groups`` codes each) until the Talker ends the speech or
        ``params.max_frames``. ``prefill``: (positions, hidden) Talker inputs; ``trailing``: the text
        still to speak, one row per step (a tensor, or a ``TextFeed`` the text arrives in while the
        Talker speaks); ``pad``: the input once it is spent."""
        if isinstance(trailing, torch.Tensor):
            trailing = FixedText(trailing)
        gen = None
        if not params.greedy:
            gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        cache = KVCache(self.cfg.talker.num_layers)
        hidden = self.model(prefill.to(self.dtype), cache)[-1]
        history: list[int] = []
        eos = self.cfg.codec_ids["eos"]
        for step in range(params.max_frames + 1):
            logits = F.linear(hidden, self.codec_head).float()
            if params.repetition_penalty != 1.0 and history:
                seen = torch.tensor(sorted(set(history)), device=logits.device)
                got = logits[seen]
                logits[seen] = torch.where(
                    got < 0, got * params.repetition_penalty, got / params.repetition_penalty
                )
            logits[self.suppressed] = float("-inf")
            code = sample(logits, params.temperature, params.top_k, params.top_p, gen)
            if code == eos or step == params.max_frames:
                return
            history.append(code)
            residual, embeds = self._residual(hidden, code, params.greedy, gen)
            yield [code, *residual]
            row = trailing.get(step)  # waits for text still being generated
            if trailing.cancelled:
                return
            x = embeds + (pad if row is None else row).to(self.dtype)
            hidden = self.model(x[None], cache)[-1]

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
