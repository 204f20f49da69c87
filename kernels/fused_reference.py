"""PyTorch references of the fused kernels (`fused.py`): the torch ops a LLaMA layer runs, with the same arguments.

Importable by other codebases' tests. `upcast=True` computes every step in fp32 and rounds once at the end (the
accuracy reference); `upcast=False` rounds where eager torch at the input dtype does (what the kernels mirror).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                           upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(residual + x), residual + x), the residual not written in place; see `add_rms_norm`."""
    dtype = x.dtype
    if upcast:
        h = x.float() if residual is None else x.float() + residual.float()
        return (weight.float() * F.rms_norm(h, (h.shape[-1],), eps=eps)).to(dtype), h.to(dtype)
    h = x if residual is None else residual + x
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(dtype), h


def rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated (q, k); see `rotary_`. Angles in fp32, cos and sin cast to q's dtype unless `upcast`."""
    freqs = positions.float()[..., None] * inv_freq  # [(B,) T, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # [(B,) T, 1, D]: broadcasts over the heads
    cos, sin = emb.cos(), emb.sin()
    out = []
    for x in (q, k):
        dtype = x.dtype
        if upcast:
            x = x.float()
        else:
            cos, sin = cos.to(dtype), sin.to(dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        out.append((x * cos + rotated * sin).to(dtype))
    return out[0], out[1]


def silu_mul_reference(gate_up: torch.Tensor, upcast: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of a merged [..., 2I] projection; see `silu_mul`."""
    gate, up = gate_up.float().chunk(2, dim=-1) if upcast else gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)
