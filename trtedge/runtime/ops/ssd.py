"""Mamba-2's selective state space (the SSD form): torch references, the oracle in tests.

Shapes: a sequence's tokens are rows; ``x`` [T, H, P] (heads of P channels), ``dt`` [T, H] (the
discretised step, softplus already applied), ``a`` [H] (negative: log decay per unit step), ``b`` and
``c`` [T, H, N] (groups already repeated to heads); the state is [H, P, N] in float32. Per token:
``s = exp(dt * a) * s + dt * x ⊗ b`` and ``y = s · c`` (the D skip is the caller's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrent_step(x, dt, a, b, c, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: ``x`` [B, H, P], ``dt`` [B, H], ``b``/``c`` [B, H, N],
    ``state`` [B, H, P, N]. Returns outputs [B, H, P] and the new state (float32)."""
    dt = dt.float()
    s = state.float() * (dt * a).exp()[..., None, None]
    s = s + (x.float() * dt[..., None]).unsqueeze(-1) * b.float().unsqueeze(-2)
    return torch.einsum("bhpn,bhn->bhp", s, c.float()), s


def chunk_scan(x, dt, a, b, c, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk-parallel: inside a chunk the outputs are a masked, decayed C·Bᵀ product
    (quadratic in the chunk); across chunks the state carries over. Returns outputs [T, H, P] and the
    final state. Padding rows have dt = 0, so they neither decay nor add to the state."""
    t = x.shape[0]
    pad = (-t) % chunk
    dt = F.pad(dt.float(), (0, 0, 0, pad))
    xdt = F.pad(x.float(), (0, 0, 0, 0, 0, pad)) * dt[..., None]
    b, c = (F.pad(v.float(), (0, 0, 0, 0, 0, pad)) for v in (b, c))
    h, n = x.shape[1], (t + pad) // chunk
    xdt, b, c = (v.transpose(0, 1).reshape(h, n, chunk, -1) for v in (xdt, b, c))  # [H, n, L, *]
    cum = (dt * a).t().reshape(h, n, chunk).cumsum(-1)  # log decay from the chunk start through each row
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    within = ((c @ b.transpose(-1, -2)) * decay) @ xdt  # [H, n, L, P]
    c_decayed = c * cum.exp().unsqueeze(-1)
    b_to_end = b * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state.float()
    out = torch.empty_like(xdt)
    for i in range(n):
        out[:, i] = within[:, i] + c_decayed[:, i] @ s.transpose(-1, -2)
        s = s * chunk_decay[:, i] + xdt[:, i].transpose(-1, -2) @ b_to_end[:, i]
    return out.reshape(h, n * chunk, -1)[:, :t].transpose(0, 1), s
