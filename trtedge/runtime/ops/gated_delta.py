"""Gated DeltaNet primitives: the short causal conv1d and the gated delta rule.

The torch versions here are the reference (CPU, any device, the oracle in tests); on CUDA the
chunked and recurrent rules run fla-core's Triton kernels when that package is installed.

Shapes: a sequence's tokens are rows; ``q``/``k`` are [T, H, Dk] and ``v`` [T, H, Dv] with H the
value-head count (key heads already repeated), ``g`` (log decay, <= 0) and ``beta`` [T, H]; the
recurrent state is [H, Dk, Dv] in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[T, G, D] -> [T, G * rep, D], each group's row repeated ``rep`` times in place (as
    ``repeat_interleave`` along dim 1, with shapes known on the host: nothing waits for the device)."""
    t, g, d = x.shape
    return x.unsqueeze(2).expand(t, g, rep, d).reshape(t, g * rep, d)


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (+ ``bias``, Mamba-2's) + silu over one sequence's new rows ``x`` [T, C],
    continuing from ``state`` [K-1, C] (the previous K-1 inputs). Returns the outputs [T, C] and the
    padded input [K-1+T, C], whose last K-1 rows (or any K-1 rows ending at a checkpoint) are the next
    state."""
    padded = torch.cat([state.to(x.dtype), x], dim=0)
    out = F.conv1d(padded.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0].t()
    return F.silu(out), padded


def causal_conv_step(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: ``x`` [B, C], ``states`` [B, K-1, C] -> outputs [B, C] and the
    new states [B, K-1, C]."""
    window = torch.cat([states.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
    out = (window * weight.t().unsqueeze(0)).sum(dim=1)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, 1:]


def recurrent_gated_delta(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. ``q``/``k``/``v`` [B, H, D*], ``g``/``beta`` [B, H], ``state`` [B, H, Dk, Dv]:
    one step for B sequences. Returns outputs [B, H, Dv] and the new state (float32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float() * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = (v - predicted) * beta[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def chunk_gated_delta(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK_SIZE):
    """One sequence, chunk-parallel (the UT / WY form): inside a chunk the delta-rule updates are
    folded into triangular solves and matmuls; across chunks the state carries over. Inputs
    [T, H, *] as in the module docstring; returns outputs [T, H, Dv] and the final state."""
    t = q.shape[0]
    pad = (-t) % chunk
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)).t() for x in (g, beta))  # [H, T']
    h, n = q.shape[0], q.shape[1] // chunk
    q, k, v = (x.reshape(h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    cum = g.cumsum(-1)  # log decay from the chunk start through each row
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay  # unit lower-triangular once the diagonal reads 1
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state.float()
    out = torch.empty_like(v)
    for i in range(n):
        fresh = u[:, i] - w[:, i] @ s  # what the state does not already predict
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ fresh
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ fresh
    return out.reshape(h, n * chunk, -1)[:, :t].transpose(0, 1), s


def fla_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def fla_chunk(q, k, v, g, beta, state):
    """fla-core's chunked kernel for one sequence (same contract as ``chunk_gated_delta``)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta = (x.float().unsqueeze(0).contiguous() for x in (q, k, v, g, beta))
    out, final = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=1.0,
        initial_state=state.float().unsqueeze(0).contiguous(),
        output_final_state=True,
    )
    return out[0].float(), final[0].float()


def fla_recurrent(q, k, v, g, beta, state):
    """fla-core's fused recurrent kernel for B sequences of one token (``recurrent_gated_delta``'s contract)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q, k, v, g, beta = (x.float().unsqueeze(1).contiguous() for x in (q, k, v, g, beta))
    out, final = fused_recurrent_gated_delta_rule(  # keywords: its fifth positional parameter is gk
        q, k, v, g=g, beta=beta, scale=1.0, initial_state=state.float().contiguous(), output_final_state=True
    )
    return out[:, 0].float(), final.float()
