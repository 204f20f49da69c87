"""Commit of a step's accepted KV entries into the cache, with no recomputation."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def commit_accepted(
    k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_len: int, step_indices: Sequence[int]
) -> None:
    """Move the accepted step entries to cache positions prefix_len .. prefix_len + len(step_indices) - 1.

    The step wrote its T entries at positions prefix_len + (0..T-1). The accepted ones (the input token,
    step index 0, then the accepted candidate's tokens) are gathered and written contiguously after the
    prefix, in place. The sequence axis is dim -2, so [B, Hkv, S, D] and stacked [layers, B, Hkv, S, D]
    caches both work, all layers in one copy.

    step_indices: strictly increasing ints >= 0 (a list or a 1-D tensor).
    """
    indices = [int(i) for i in step_indices]
    if any(b <= a for a, b in zip(indices, indices[1:], strict=False)) or (indices and indices[0] < 0):
        raise ValueError(f"step_indices must be strictly increasing and >= 0, got {indices}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if indices and prefix_len + indices[-1] >= k_cache.shape[-2]:
        raise ValueError(
            f"step index {indices[-1]} at prefix_len {prefix_len} is past the cache's {k_cache.shape[-2]} positions"
        )
    # entries already in place (a leading run 0, 1, 2, ...) need no copy
    first_moved = next((j for j, i in enumerate(indices) if i != j), len(indices))
    if first_moved == len(indices):
        return
    src = torch.tensor(indices[first_moved:], device=k_cache.device) + prefix_len
    dst = slice(prefix_len + first_moved, prefix_len + len(indices))
    for cache in (k_cache, v_cache):
        cache[..., dst, :] = cache.index_select(cache.ndim - 2, src)
