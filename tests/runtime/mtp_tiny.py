"""Tiny MTP layers for tests: ``add_mtp_layers`` writes the ``mtp.*`` tensors of one Qwen3.5 MTP layer
beside a tiny checkpoint; ``Reference`` is a straightforward torch rendering of the published layout
(transformers' own decoder layer inside it) that the drafts are compared with."""

from __future__ import annotations

import json

import torch
import transformers

FULL_ATTENTION_LAYER = 1  # of the tiny model: its config shapes the MTP layer


def add_mtp_layers(directory, moe: bool = False, seed: int = 1, declare: bool = True) -> dict:
    """Write one MTP layer (``mtp.*``, in its own file as released checkpoints do) beside the model and
    declare it in config.json; returns the tensors."""
    from safetensors.torch import save_file

    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())
    torch.manual_seed(seed)
    layer = _hf_layer(raw, moe)
    h = raw["hidden_size"]
    tensors = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.1
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[f"mtp.{name}.weight"] = torch.randn(h) * 0.2
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "mtp.safetensors"))
    if declare:
        raw["mtp_num_hidden_layers"] = 1
        config_file.write_text(json.dumps(raw))
    return tensors


def _hf_config(raw: dict, moe: bool):
    fields = {
        k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")
    }
    return (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**fields)


def _hf_layer(raw: dict, moe: bool):
    module = (
        transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
        if moe
        else transformers.models.qwen3_5.modeling_qwen3_5
    )
    cls = module.Qwen3_5MoeDecoderLayer if moe else module.Qwen3_5DecoderLayer
    layer = cls(_hf_config(raw, moe), FULL_ATTENTION_LAYER).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred norms: random, so that a wrong formula shows
                p.normal_(0.0, 0.2)
            elif p.dim() == 3:  # fused experts start empty
                p.normal_(0.0, 0.1)
    return layer


class Reference:
    """The published layout, written out: norm(embed(token)) and norm(hidden) concatenated, fc,
    transformers' decoder layer over the rows (causal), the final norm, the model's lm head."""

    def __init__(self, directory, tensors: dict, moe: bool = False):
        raw = json.loads((directory / "config.json").read_text())
        cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
        self.model = cls.from_pretrained(directory, dtype=torch.float32).eval()
        self.layer = _hf_layer(raw, moe)
        prefix = "mtp.layers.0."
        self.layer.load_state_dict(
            {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        )
        self.w = tensors
        self.eps = raw["rms_norm_eps"]

    def _norm(self, x, weight):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + weight.float())

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self.model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def rows(self, hidden, next_tokens: list[int], positions: list[int]):
        """(logits, normed outputs) of MTP rows ``(hidden[i], next_tokens[i])`` at ``positions``."""
        w = self.w
        e = self._norm(
            self.model.model.embed_tokens.weight[torch.tensor(next_tokens)],
            w["mtp.pre_fc_norm_embedding.weight"],
        )
        x = torch.cat([e, self._norm(hidden, w["mtp.pre_fc_norm_hidden.weight"])], -1) @ w["mtp.fc.weight"].T
        pos = torch.tensor([positions])
        # (3, batch, positions), the rotary's grid form: transformers 5.17 needs it (5.25 also takes [1, T])
        cos_sin = self.model.model.rotary_emb(x[None], pos[None].expand(3, -1, -1))
        t = x.shape[0]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)[0]
        out = self._norm(x, w["mtp.norm.weight"])
        return self.model.lm_head(out), out

    def chain(self, tokens: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """The k-token greedy chain after ``tokens`` and each step's logits, each step recomputed from
        scratch over every row."""
        n = len(tokens)
        hidden = self.target_hidden(tokens[:-1])
        nexts, positions = list(tokens[1:]), list(range(n - 1))
        drafts, steps = [], []
        for _ in range(k):
            logits, out = self.rows(hidden, nexts, positions)
            steps.append(logits[-1])
            drafts.append(int(logits[-1].argmax()))
            hidden = torch.cat([hidden, out[-1:]])
            nexts.append(drafts[-1])
            positions.append(positions[-1] + 1)
        return drafts, steps


NEMOTRON_MTP_BLOCKS = ["full_attention", "moe"]  # the released checkpoints' MTP module


def _nemotron_blocks(directory):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    config = transformers.NemotronHConfig.from_pretrained(directory)
    config.layers_block_type = NEMOTRON_MTP_BLOCKS  # the blocks' kinds (transformers picks by index)
    blocks = [NemotronHBlock(config, i).eval() for i in range(len(NEMOTRON_MTP_BLOCKS))]
    with torch.no_grad():
        for block in blocks:
            for name, p in block.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.2)
                elif p.dim() == 3 or name.endswith("e_score_correction_bias"):
                    p.normal_(0.0, 0.1)
    return blocks


def add_nemotron_mtp_layers(directory, seed: int = 1) -> dict:
    """Write Nemotron-H's MTP module (an attention block, then a MoE block: ``mtp.layers.{0,1}.*``, the
    first with enorm / hnorm / eh_proj, the last with final_layernorm) and num_nextn_predict_layers 1."""
    from safetensors.torch import save_file

    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())
    torch.manual_seed(seed)
    h = raw["hidden_size"]
    tensors = {}
    for i, block in enumerate(_nemotron_blocks(directory)):
        tensors.update({f"mtp.layers.{i}.{k}": v.detach().clone() for k, v in block.state_dict().items()})
    tensors["mtp.layers.0.enorm.weight"] = 1.0 + torch.randn(h) * 0.2
    tensors["mtp.layers.0.hnorm.weight"] = 1.0 + torch.randn(h) * 0.2
    tensors["mtp.layers.0.eh_proj.weight"] = torch.randn(h, 2 * h) * 0.1
    tensors[f"mtp.layers.{len(NEMOTRON_MTP_BLOCKS) - 1}.final_layernorm.weight"] = 1.0 + torch.randn(h) * 0.2
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "mtp.safetensors"))
    raw.update(num_nextn_predict_layers=1, mtp_layers_block_type=NEMOTRON_MTP_BLOCKS)
    config_file.write_text(json.dumps(raw))
    return tensors


class NemotronReference(Reference):
    """Nemotron-H's MTP module written out: enorm(embed) and hnorm(hidden) concatenated, eh_proj,
    transformers' blocks (attention without positions, MoE), final_layernorm, the model's lm head."""

    def __init__(self, directory, tensors: dict):
        raw = json.loads((directory / "config.json").read_text())
        self.model = transformers.NemotronHForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.blocks = _nemotron_blocks(directory)
        for i, block in enumerate(self.blocks):
            prefix = f"mtp.layers.{i}."
            extra = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")
            own = {k: v for k, v in tensors.items() if k.startswith(prefix) and not k.endswith(extra)}
            block.load_state_dict({k.removeprefix(prefix): v for k, v in own.items()})
        self.w = tensors
        self.eps = raw["layer_norm_epsilon"]

    def _plain_norm(self, x, weight):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight.float()

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self.model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def rows(self, hidden, next_tokens: list[int], positions: list[int]):
        w, last = self.w, len(self.blocks) - 1
        e = self._plain_norm(
            self.model.model.embeddings.weight[torch.tensor(next_tokens)], w["mtp.layers.0.enorm.weight"]
        )
        h = self._plain_norm(hidden, w["mtp.layers.0.hnorm.weight"])
        x = (torch.cat([e, h], -1) @ w["mtp.layers.0.eh_proj.weight"].T)[None]
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        out = self._plain_norm(x[0], w[f"mtp.layers.{last}.final_layernorm.weight"])
        return self.model.lm_head(out), out
