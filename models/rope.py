"""Rotary position embeddings in fp32 (never stored in the model dtype), HF's rotate-half layout."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with `linear` or `llama3` scaling applied, on `device` (None: torch's
    default, which is "meta" inside `with torch.device("meta")`). Computed on the CPU and moved: on the meta device
    its ops go through torch._refs, whose first call imports torch._dynamo (~75 MB resident) for a model that is
    about to be loaded."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    inv_freq = _scaled(inv_freq, rope)
    return inv_freq.to(torch.empty(0).device if device is None else device)


def _scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths scaled down by `factor`, short ones kept, a smooth blend between
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class Angles(NamedTuple):
    """A step's rotary angles, cos and sin [(B,) T, 1, D] in the model's dtype: they broadcast over heads."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def at(cls, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        """The angles of `positions` ([T], or [B, T] per row): fp32, cast once to `dtype` as transformers does."""
        return cls(*(c.to(dtype).unsqueeze(-2) for c in rotary_cos_sin(inv_freq, positions)))


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, head_dim] in fp32 for integer positions [..., T] ([T], or [B, T] for per-row positions)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, T, Hq, D] and k [B, T, Hkv, D] together: one set of rotary ops per layer instead of two."""
    rotated = apply_rotary(torch.cat((q, k), dim=2), cos, sin)
    return rotated.split((q.shape[2], k.shape[2]), dim=2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., D] by cos, sin broadcastable to it (already in x's dtype, as HF casts them)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
