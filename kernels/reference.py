"""PyTorch references of the lookahead attention: SDPA with the dense mask of `StepPattern`, over a dense cache
(`reference_attention`) or packed steps over a paged cache (`paged_reference_attention`).

Importable by other codebases' tests, like FlagAttention's `testing` module. The dense one is also the CPU
backend of the model, where a dense mask of a few hundred rows costs nothing next to the matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    batch = q.shape[0]
    lengths = prefix_len.tolist() if isinstance(prefix_len, torch.Tensor) else [prefix_len] * batch
    trees = [None] * batch if tree_end is None else tree_end.tolist() if per_row_tree else [tree_end.tolist()] * batch
    mask = batched_mask(lengths, [_pattern(window, ngram, guesses, tree) for tree in trees]).to(q.device)
    width = mask.shape[-1] - q.shape[2]
    return masked_attention(q, k, v, width, mask, sm_scale, upcast)


def batched_mask(lengths: Sequence[int], patterns: Sequence[StepPattern]) -> torch.Tensor:
    """Bool [B, 1, T, max(L) + T] mask (True = attend) for rows of per-row prefix lengths and step patterns (of T
    tokens each). Row b sees positions < L_b, then its step keys at L_b .. L_b + T - 1 by its pattern; nothing beyond.
    """
    t = patterns[0].num_tokens
    width = max(lengths, default=0) + t
    mask = torch.zeros(len(lengths), 1, t, width, dtype=torch.bool)
    for b, (length, pattern) in enumerate(zip(lengths, patterns, strict=True)):
        mask[b, 0, :, : length + t] = pattern.materialize(length)
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


def paged_reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_len: torch.Tensor,
    window: torch.Tensor,
    ngram: torch.Tensor,
    tree_end: torch.Tensor,
    sm_scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """`paged_attention` by SDPA, one row at a time: gather the row's L_b + T_b keys/values through its block table,
    build its mask with `StepPattern(W_b, N_b, tree_end=...).materialize(L_b)`, attend.

    Shapes as `paged_attention`: q [ΣT, Hq, D]; k_cache, v_cache [num_blocks, Hkv, block_size, D]; block_table
    [B, max_blocks]; cu_seqlens [B + 1]; prefix_len, window, ngram [B]; tree_end [ΣT] aligned with q. Returns
    [ΣT, Hq, D] in q's dtype (zeros for tokens of no row). `upcast` as in `reference_attention`. Values are read on
    the host; inputs are not checked (the kernel's entry checks them).
    """
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    block_size = k_cache.shape[2]
    cu, ends = cu_seqlens.tolist(), tree_end.tolist()
    for b, (length, w, n) in enumerate(zip(prefix_len.tolist(), window.tolist(), ngram.tolist(), strict=True)):
        start, stop = cu[b], cu[b + 1]
        if stop == start:
            continue
        pattern = StepPattern(w, n, 0, tuple(ends[start + w * (n - 1) : stop]))
        positions = torch.arange(length + stop - start, device=k_cache.device)
        blocks = block_table[b].to(k_cache.device)[positions // block_size]
        k = k_cache[blocks, :, positions % block_size].transpose(0, 1)[None]  # [1, Hkv, L + T, D]
        v = v_cache[blocks, :, positions % block_size].transpose(0, 1)[None]
        rows = q[start:stop].transpose(0, 1)[None]  # [1, Hq, T, D]
        mask = pattern.materialize(length, device=q.device)
        out[start:stop] = masked_attention(rows, k, v, length, mask, sm_scale, upcast)[0].transpose(0, 1)
    return out
