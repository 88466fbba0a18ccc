"""A tiny llama whose greedy output is scripted: the next token depends only on the current one.

Embeddings are orthonormal and every layer's output projections are zero, so the last hidden state is
the current token's embedding; the lm_head row of each scripted successor points at its predecessor.
The chat template renders tools, tool calls and tool results, and ends the prompt with a word that
starts the script: <call> when tools are offered, <answer> after a tool result, <count> for a user
message "count" (an endless "one one ..."), <think> when thinking is on ("hmm </think> Hello world"),
<reply> otherwise ("Hello world")."""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS = "</s>"
CALL = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
SCRIPT = {
    "<reply>": "Hello",
    "Hello": "world",
    "world": EOS,
    "<call>": CALL[0],
    **dict(zip(CALL, CALL[1:] + [EOS])),
    "<answer>": "Sunny",
    "Sunny": "in",
    "in": "Paris.",
    "Paris.": EOS,
    "<count>": "one",
    "one": "one",
    "<think>": "hmm",
    "hmm": "</think>",
    "</think>": "Hello",
}
TEMPLATE = (
    "{% if tools %}<tools> {{ tools | tojson }} </tools> {% endif %}"
    "{% for m in messages %}<{{ m.role }}> {% if m.content %}{{ m.content }} {% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call> "
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }} </tool_call> {% endfor %}"
    "{% if m.role == 'tool' %}(for {{ m.tool_call_id }}) {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% if messages[-1].role == 'tool' %}<answer> "
    "{% elif messages[-1].content == 'count' %}<count> {% elif tools %}<call> "
    "{% elif enable_thinking %}<think> {% else %}<reply> {% endif %}"
    "{% endif %}"
)
SIZE = 128


def make_scripted_checkpoint(directory: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", EOS]
    for word in [*SCRIPT, *SCRIPT.values()]:
        if word not in words:
            words.append(word)
    words += [f"w{i}" for i in range(SIZE - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    config = transformers.LlamaConfig(
        vocab_size=SIZE,
        hidden_size=SIZE,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        basis, _ = torch.linalg.qr(torch.randn(SIZE, SIZE))
        model.model.embed_tokens.weight.copy_(basis)
        head = torch.zeros(SIZE, SIZE)
        for word, after in SCRIPT.items():
            head[vocab[after]] += 20 * basis[vocab[word]]
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": EOS, "chat_template": TEMPLATE})
    )
    return directory
