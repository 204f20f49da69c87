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
    prefix_len: int | torch.Tensor,
    window: int,
    ngram: int,
    guesses: int,
    sm_scale: float | None = None,
    upcast: bool = False,
    *,
    tree_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lookahead attention by `scaled_dot_product_attention` with an explicit bool mask.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; row b holds its prefix (positions < prefix_len[b]) then the step's T
    keys. prefix_len: an int or an integer tensor [B]; tree_end: None (chains of `guesses` candidates) or an
    integer tensor [V] or [B, V] (tree form, `guesses` ignored). Returns [B, Hq, T, D] in q's dtype.
    `upcast=True` computes in fp32 (the accuracy reference); `upcast=False` computes in the input dtype
    (eager PyTorch at that precision).
    """
    per_row_tree = tree_end is not None and tree_end.ndim == 2
    if isinstance(prefix_len, int) and not per_row_tree:
        pattern = _pattern(window, ngram, guesses, None if tree_end is None else tree_end.tolist())
        mask = pattern.materialize(prefix_len, device=q.device)
        return masked_attention(q, k, v, prefix_len, mask, sm_scale, upcast)
    mask = batched_mask(q.shape[0], prefix_len, window, ngram, guesses, tree_end).to(q.device)
    width = mask.shape[-1] - q.shape[2]
    return masked_attention(q, k, v, width, mask, sm_scale, upcast)


def batched_mask(batch: int, prefix_len: int | torch.Tensor, window: int, ngram: int, guesses: int,
                 tree_end: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, 1, T, max(L) + T] mask (True = attend) for per-row prefix lengths and/or per-row trees.

    Row b sees positions < L_b, then its step keys at L_b .. L_b + T - 1 by the pattern; nothing beyond.
    """
    lengths = prefix_len.tolist() if isinstance(prefix_len, torch.Tensor) else [prefix_len] * batch
    if tree_end is None:
        trees = [None] * batch
    else:
        rows = tree_end.tolist()
        trees = rows if tree_end.ndim == 2 else [rows] * batch
    t = _pattern(window, ngram, guesses, trees[0]).num_tokens
    width = max(lengths, default=0) + t
    mask = torch.zeros(batch, 1, t, width, dtype=torch.bool)
    for b, (length, tree) in enumerate(zip(lengths, trees, strict=True)):
        mask[b, 0, :, : length + t] = _pattern(window, ngram, guesses, tree).materialize(length)
    return mask


def _pattern(window: int, ngram: int, guesses: int, tree: list[int] | None) -> StepPattern:
    return StepPattern(window, ngram, guesses) if tree is None else StepPattern(window, ngram, 0, tuple(tree))


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    mask: torch.Tensor | None,
    sm_scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """SDPA over the first prefix_len + T keys with a prebuilt bool mask [T, prefix_len + T] or
    [B, 1, T, prefix_len + T] (None: all visible)."""
    t = q.shape[2]
    k, v = k[:, :, : prefix_len + t], v[:, :, : prefix_len + t]
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    return out.to(dtype)
