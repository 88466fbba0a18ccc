"""The peer for batch-1 decode: a gpt-fast-style Llama / Qwen3 decoder written here (random weights of a
benchmark shape, a static KV cache, the decode step under ``torch.compile(mode="reduce-overhead")``,
greedy argmax inside the compiled step so that no step waits for the host).

    python benchmarks/compiled_peer.py [--shape llama-1b] [--new-tokens 256]

``benchmarks/gpu_decode.py`` runs it next to trtedge in the same process (``--no-peer`` skips it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import shape_config  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: dict, max_seq: int, batch: int):
        super().__init__()
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.wqkv = nn.Linear(cfg["hidden_size"], self.q_size + 2 * self.kv_size, bias=False)
        self.wo = nn.Linear(self.q_size, cfg["hidden_size"], bias=False)
        qk_norm = cfg["model_type"] == "qwen3"
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        shape = (batch, self.kv_heads, max_seq, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (rotate(q, cos, sin), rotate(k, cos, sin), v))
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.q_size))


class Block(nn.Module):
    def __init__(self, cfg: dict, max_seq: int, batch: int):
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.attention = Attention(cfg, max_seq, batch)
        self.w_gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.w_down = nn.Linear(inter, hidden, bias=False)
        self.attention_norm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.ffn_norm = RMSNorm(hidden, cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        gate, up = self.w_gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, cfg: dict, max_seq: int, batch: int = 1):
        super().__init__()
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(cfg, max_seq, batch) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.output = nn.Linear(hidden, vocab, bias=False)
        if cfg["tie_word_embeddings"]:
            self.output.weight = self.embed.weight
        head_dim = self.layers[0].attention.head_dim
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_seq).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        causal = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos = self.cos[input_pos].to(x.dtype)[None, :, None, :]
        sin = self.sin[input_pos].to(x.dtype)[None, :, None, :]
        mask = self.causal[None, None, input_pos]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x)).float()


def decode_one(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(token, input_pos)[:, -1].argmax(-1, keepdim=True)


def build(shape: str | dict, max_seq: int, device: str = "cuda", dtype=torch.bfloat16) -> Transformer:
    """Random weights for a benchmark shape's name, or for an HF config dict."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(shape if isinstance(shape, dict) else shape_config(shape), max_seq)
        model = model.to(dtype).eval()
    for p in model.parameters():  # random weights at a trained model's scale
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    return model


@torch.no_grad()
def generate(model: Transformer, step, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``prompt`` and the decode rate (tokens/s, the first token excluded)."""
    device = model.cos.device
    ids = torch.tensor([prompt], device=device)
    token = decode_one(model, ids, torch.arange(len(prompt), device=device))  # prefill, eager
    tokens = [token]
    input_pos = torch.tensor([len(prompt)], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        torch.compiler.cudagraph_mark_step_begin()
        token = step(model, token, input_pos).clone()  # the graph's output is overwritten next replay
        input_pos += 1
        tokens.append(token)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return torch.cat(tokens, dim=1)[0].tolist(), (new_tokens - 1) / elapsed


def peer_decode(shape: str, prompt: list[int], new_tokens: int) -> float:
    """tokens/s of the compiled static-cache decode (compiles and warms up first)."""
    model = build(shape, max_seq=len(prompt) + new_tokens + 16)
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    generate(model, step, prompt, 16)  # compile, capture
    _, rate = generate(model, step, prompt, new_tokens)
    del model, step
    torch.cuda.empty_cache()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    prompt = torch.randint(10, 128000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    rate = peer_decode(args.shape, prompt, args.new_tokens)
    print(
        json.dumps(
            dict(
                figure="batch1_decode",
                engine="torch-compile-peer",
                shape=args.shape,
                tokens_per_s=round(rate, 1),
            )
        )
    )


if __name__ == "__main__":
    main()
