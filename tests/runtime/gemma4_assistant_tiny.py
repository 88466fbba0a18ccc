"""A tiny Gemma 4 assistant drafter for the tiny Gemma 4 target (tests/tiny.py's ``gemma4``), and
transformers' ``Gemma4AssistantForCausalLM`` driven as its candidate generator drives it: the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import PLE_VOCAB


def make_tiny_assistant(directory: Path, ordered: bool = False, seed: int = 0) -> Path:
    """A random 2-layer assistant (a sliding and a global layer, the target's head sizes) at width 32 over
    the 64-wide target; ``ordered``: logits over the tokens of the 2 best of 10 centroids only."""
    import transformers

    text = transformers.AutoConfig.for_model("gemma4_text").__class__(
        vocab_size=PLE_VOCAB,
        vocab_size_per_layer_input=0,
        hidden_size=32,
        hidden_size_per_layer_input=0,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = transformers.Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=64,
        use_ordered_embeddings=ordered,
        num_centroids=10,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
            if name.endswith("token_ordering"):
                b.copy_(torch.randperm(PLE_VOCAB))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


class AssistantReference:
    """transformers' target and assistant: the drafts (and each step's logits) the assistant makes for a
    sequence whose last token the target has not computed yet."""

    def __init__(self, target_dir: Path, assistant_dir: Path):
        import transformers

        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=torch.float32
        ).eval()
        self.assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(
            assistant_dir, dtype=torch.float32
        ).eval()

    @torch.no_grad()
    def drafts(self, token_ids: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        out = self.target.model(
            input_ids=torch.tensor([token_ids[:-1]]), output_hidden_states=True, return_shared_kv_states=True
        )
        hidden = out.hidden_states[-1][:, -1:]
        kv = out.shared_kv_states
        last = torch.tensor([token_ids[-1:]])
        position = torch.tensor([[len(token_ids) - 1]])
        embed = self.target.get_input_embeddings()
        tokens, logits = [], []
        for _ in range(k):
            step = self.assistant(
                inputs_embeds=torch.cat([embed(last), hidden], dim=-1),
                position_ids=position,
                shared_kv_states=kv,
                use_cache=False,
            )
            last = step.logits.argmax(dim=-1)
            hidden = step.last_hidden_state
            tokens.append(int(last))
            logits.append(step.logits[0, 0])
        return tokens, torch.stack(logits)
