"""The model's attention for one forward pass: plain causal, or a lookahead step through a backend.

Backends: "triton" runs `lookahead_attention` (the pattern computed in the kernel); "torch" runs SDPA
with the step's dense mask, which on CPU is the fastest choice for a few hundred query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lookahead.kernels import StepPattern, lookahead_attention, masked_attention

from .kv_cache import KVCache

BACKENDS = ("auto", "torch", "triton")


@dataclass
class AttentionContext:
    """How the layers of one forward pass attend.

    cache None: a plain causal forward with no cache. pattern None: a causal prefill written at
    positions prefix_len.. of the cache. Otherwise a lookahead step; `mask` is the torch backend's
    [T, prefix_len + T] bool mask (None when every key is visible).
    """

    backend: str
    cache: KVCache | None = None
    prefix_len: int = 0
    pattern: StepPattern | None = None
    mask: torch.Tensor | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, D], this layer's new k, v [B, Hkv, T, D] -> [B, Hq, T, D]."""
        if self.cache is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)
        k_all, v_all = self.cache.write(layer, self.prefix_len, k, v)
        end = self.prefix_len + q.shape[2]
        if self.pattern is None:
            if self.prefix_len == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)
            mask = torch.ones(q.shape[2], end, dtype=torch.bool, device=q.device).tril(self.prefix_len)
            return masked_attention(q, k_all, v_all, self.prefix_len, mask)
        if self.backend == "triton":
            p = self.pattern
            return lookahead_attention(q, k_all, v_all, self.prefix_len, p.window, p.ngram, p.guesses)
        return masked_attention(q, k_all, v_all, self.prefix_len, self.mask)
