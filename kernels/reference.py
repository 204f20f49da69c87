"""PyTorch reference of the lookahead attention: SDPA with the dense mask of `StepPattern`.

Importable by other codebases' tests, like FlagAttention's `testing` module. It is also the CPU
backend of the model, where a dense mask of a few hundred rows costs nothing next to the matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pattern import StepPattern


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    window: int,
    ngram: int,
    guesses: int,
    sm_scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Lookahead attention by `scaled_dot_product_attention` with an explicit bool mask.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] with S >= prefix_len + T (only the first prefix_len + T
    are read); returns [B, Hq, T, D] in q's dtype. `upcast=True` computes in fp32 (the accuracy
    reference); `upcast=False` computes in the input dtype (eager PyTorch at that precision).
    """
    pattern = StepPattern(window, ngram, guesses)
    mask = pattern.materialize(prefix_len, device=q.device)
    return masked_attention(q, k, v, prefix_len, mask, sm_scale, upcast)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    mask: torch.Tensor | None,
    sm_scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """SDPA over the first prefix_len + T keys with a prebuilt bool mask [T, prefix_len + T] (None: all visible)."""
    t = q.shape[2]
    k, v = k[:, :, : prefix_len + t], v[:, :, : prefix_len + t]
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    return out.to(dtype)
