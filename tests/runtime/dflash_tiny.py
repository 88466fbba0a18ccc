"""A tiny random DFlash draft in the published layout for tests (``write_dflash``), and ``Reference``: the
published drafting written out with transformers' Qwen3 pieces, recomputed from scratch for every block."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

DRAFT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
)


def _draft_config(num_layers: int) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=512, num_hidden_layers=num_layers, **DRAFT)


def write_dflash(
    directory,
    target_layer_ids=(0, 1),
    block_size: int = 4,
    num_layers: int = 2,
    mask_token_id: int = 511,
    seed=3,
) -> dict:
    """A DFlash draft (``num_layers`` Qwen3 layers, fc over the target's 64-wide states after
    ``target_layer_ids``) in ``directory``; returns its tensors."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    torch.manual_seed(seed)
    config = _draft_config(num_layers)
    h = config.hidden_size
    tensors = {}
    for i in range(num_layers):
        layer = Qwen3DecoderLayer(config, i)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("norm.weight"):  # random, not identity, so that a wrong formula shows
                    p.normal_(1.0, 0.2)
                else:
                    p.normal_(0.0, 0.1)
        tensors.update({f"layers.{i}.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
    tensors["fc.weight"] = torch.randn(h, len(target_layer_ids) * h) * 0.1
    tensors["hidden_norm.weight"] = 1.0 + torch.randn(h) * 0.2
    tensors["norm.weight"] = 1.0 + torch.randn(h) * 0.2
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    raw = config.to_dict() | {
        "architectures": ["DFlashDraftModel"],
        "dflash_config": {
            "target_layer_ids": list(target_layer_ids),
            "block_size": block_size,
            "mask_token_id": mask_token_id,
        },
    }
    (directory / "config.json").write_text(json.dumps(raw))
    return tensors


class Reference:
    """The block a DFlash draft proposes after ``tokens`` (the target has computed all but the last):
    the target's hidden states after the tapped layers (transformers' ``hidden_states[i + 1]``) through
    fc and hidden_norm are the context; the anchor and ``block_size - 1`` mask tokens (the target's
    embedding) pass the layers, whose queries are the block's and keys / values those of
    [context, block], with no mask; the final norm; the target's lm head."""

    def __init__(self, target_dir, draft_dir):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

        raw = json.loads((draft_dir / "config.json").read_text())
        self.settings = raw["dflash_config"]
        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=torch.float32
        ).eval()
        config = _draft_config(raw["num_hidden_layers"])
        from safetensors.torch import load_file

        w = load_file(str(draft_dir / "model.safetensors"))
        self.layers = []
        for i in range(raw["num_hidden_layers"]):
            layer = Qwen3DecoderLayer(config, i).eval()
            prefix = f"layers.{i}."
            layer.load_state_dict({k.removeprefix(prefix): v for k, v in w.items() if k.startswith(prefix)})
            self.layers.append(layer)
        self.w, self.config = w, config
        self.rotary = Qwen3RotaryEmbedding(config)

    def _norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * weight

    @torch.no_grad()
    def block_logits(self, tokens: list[int]) -> torch.Tensor:
        """[block_size - 1, vocab]: the logits of the block's mask rows."""
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        bs, n, c = self.settings["block_size"], len(tokens), self.config
        states = self.target.model(
            input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True
        ).hidden_states
        taps = torch.cat([states[i + 1][0] for i in self.settings["target_layer_ids"]], dim=-1)
        context = self._norm(taps @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])
        block = [tokens[-1]] + [self.settings["mask_token_id"]] * (bs - 1)
        x = self.target.model.embed_tokens.weight[torch.tensor(block)]
        cos, sin = self.rotary(x[None], torch.arange(n - 1 + bs)[None])
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        for layer in self.layers:
            att = layer.self_attn
            h = layer.input_layernorm(x)
            both = torch.cat([context, h])
            q = att.q_norm(att.q_proj(h).view(bs, heads, d)).transpose(0, 1)[None]
            k = att.k_norm(att.k_proj(both).view(-1, kv_heads, d)).transpose(0, 1)[None]
            v = att.v_proj(both).view(-1, kv_heads, d).transpose(0, 1)[None]
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            q, _ = apply_rotary_pos_emb(q, q, cos[:, -bs:], sin[:, -bs:])
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # no mask: the block sees it all
            x = x + att.o_proj(o[0].transpose(0, 1).reshape(bs, heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.target.lm_head(self._norm(x, self.w["norm.weight"]))[1:]
