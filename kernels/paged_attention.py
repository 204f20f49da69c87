"""The checked entry of the lookahead attention over packed (varlen) steps and a paged KV cache: `paged_attention`.

Every input is checked here, once, with the values read on the host; the launch is a `PagedAttentionPlan` sized for
this call (a model builds its plan once and calls it with device tensors instead).
"""

from __future__ import annotations

import torch

from .pattern import check_tree_end
from .triton_attention import (
    _MAX_HEAD_DIM,
    PagedAttentionPlan,
    Rows,
    _check_are_tensors,
    _check_dtype,
    _check_integer_tensor,
    _check_runnable,
    _check_sm_scale,
)

__all__ = ["paged_attention"]

_MAX_POSITION = 2**31 - 1  # positions and step indices are 32-bit in the kernel


def paged_attention(
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
) -> torch.Tensor:
    """Attention of B packed lookahead steps, each row with its own step, over a paged KV cache (no mask tensor).

    Args:
        q: [ΣT, Hq, D], any strides: row b's T_b step tokens are q[cu_seqlens[b] : cu_seqlens[b + 1]], in its step
            layout (docs/DESIGN.md: the lookahead branch's W_b(N_b - 1) tokens, then V_b tree nodes in pre-order).
        k_cache, v_cache: [num_blocks, Hkv, block_size, D], any strides (e.g. a permuted view of a per-layer
            [Hkv, num_blocks * block_size, D] buffer); any block_size >= 1. Hq % Hkv == 0.
        block_table: [B, max_blocks] int32/int64: position p of row b lives in block block_table[b, p // block_size] at
            offset p % block_size. Rows may share blocks. Entries past a row's L_b + T_b positions are not read.
        cu_seqlens: [B + 1] integer, 0 = cu_seqlens[0] <= ... <= cu_seqlens[B] = ΣT; T_b = 0 is an idle row.
        prefix_len: [B] integer L_b >= 0. The step's keys/values were written at positions L_b .. L_b + T_b - 1 of
            row b (through its table) before the call; positions 0 .. L_b + T_b - 1 are read.
        window, ngram: [B] integer W_b >= 1, N_b >= 2 (a plain row or a prefill chunk: W = 1, N = 2).
        tree_end: [ΣT] integer, aligned with q: for row b's step index i >= W_b(N_b - 1) (tree node
            j = i - W_b(N_b - 1)), one past the pre-order index of the last node of j's subtree (node-relative);
            entries of lookahead tokens are ignored. T_b = W_b(N_b - 1) + V_b. A prefill chunk of C tokens is W = 1,
            N = 2 and the path tree tree_end = (C - 1,) * (C - 1): causal attention after the prefix.
        sm_scale: softmax scale, default 1 / sqrt(D).

    Returns:
        [ΣT, Hq, D] contiguous, in q's dtype (float16, bfloat16 or float32).
    """
    given = Rows(block_table, cu_seqlens, prefix_len, window, ngram, tree_end)
    lengths, tokens = _check_paged_inputs(q, k_cache, v_cache, given, sm_scale)
    if q.shape[0] == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    plan = PagedAttentionPlan(heads_q=q.shape[1], heads_kv=k_cache.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                              device=q.device, max_rows=len(tokens), max_row_tokens=max(tokens),
                              max_len=max(lengths), sm_scale=sm_scale)
    rows = [x.contiguous() for x in (cu_seqlens, prefix_len, window, ngram)]  # the kernel reads them unstrided
    return plan(q, k_cache, v_cache, block_table, rows[0], *rows[1:], tree_end)


def _check_paged_inputs(q, k_cache, v_cache, rows: Rows, sm_scale) -> tuple[list[int], list[int]]:
    """Every check of `paged_attention`; returns the rows' prefix lengths and token counts."""
    block_table, cu_seqlens, prefix_len, window, ngram, tree_end = rows
    _check_are_tensors({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be 3-D [ΣT, Hq, D] and k_cache, v_cache 4-D [num_blocks, Hkv, block_size, D] with "
                         f"equal shapes; got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    total, heads_q, head_dim = q.shape
    num_blocks, heads_kv, block_size, _ = k_cache.shape
    if k_cache.shape[3] != head_dim or head_dim == 0:
        raise ValueError(f"q and k_cache must share a head dim >= 1; got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}")
    if heads_q == 0 or heads_kv == 0:
        raise ValueError(f"q and k_cache need at least one head; got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}")
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of KV heads ({heads_kv})")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is larger than the kernel's maximum {_MAX_HEAD_DIM}")
    if num_blocks == 0 or block_size == 0:
        raise ValueError(f"k_cache needs at least one block of at least one position, got {tuple(k_cache.shape)}")
    _check_dtype(q.dtype)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache must be on one device; got {q.device}, {k_cache.device}, "
                         f"{v_cache.device}")
    _check_sm_scale(sm_scale)

    if not isinstance(block_table, torch.Tensor) or block_table.ndim != 2:
        raise ValueError(f"block_table must be a 2-D integer tensor [B, max_blocks], got "
                         f"{tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}")
    batch, max_blocks = block_table.shape
    _check_integer_tensor("block_table", block_table, q.device, [(batch, max_blocks)])
    _check_integer_tensor("cu_seqlens", cu_seqlens, q.device, [(batch + 1,)])
    for name, x in (("prefix_len", prefix_len), ("window", window), ("ngram", ngram)):
        _check_integer_tensor(name, x, q.device, [(batch,)])
    _check_integer_tensor("tree_end", tree_end, q.device, [(total,)])

    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(a > b for a, b in zip(cu, cu[1:], strict=False)) or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at q's {total} tokens; got {cu}")
    lengths, windows, ngrams = prefix_len.tolist(), window.tolist(), ngram.tolist()
    for name, values, low in (("prefix_len", lengths, 0), ("window", windows, 1), ("ngram", ngrams, 2)):
        bad = [b for b, x in enumerate(values) if x < low]
        if bad:
            raise ValueError(f"{name} must be >= {low} in every row; got {name}[{bad[0]}] = {values[bad[0]]} "
                             f"({name}={values})")
    tokens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    ends, table = tree_end.tolist(), block_table.tolist()
    for b, (t, length, w, n) in enumerate(zip(tokens, lengths, windows, ngrams, strict=True)):
        if t == 0:  # an idle row: nothing of it is read
            continue
        lookahead = w * (n - 1)
        if t < lookahead:
            raise ValueError(f"row {b} has {t} step tokens (cu_seqlens={cu}); window={w}, ngram={n} needs at least "
                             f"W(N - 1) = {lookahead}, plus its tree's nodes")
        check_tree_end(ends[cu[b] + lookahead : cu[b + 1]], f"row {b}'s tree_end")
        if length + t > _MAX_POSITION:
            raise ValueError(f"row {b} reads prefix_len + T = {length} + {t} positions, more than {_MAX_POSITION}")
        needed = -(-(length + t) // block_size)
        if needed > max_blocks:
            raise ValueError(f"row {b} reads prefix_len + T = {length} + {t} positions, {needed} blocks of "
                             f"{block_size}, but block_table has {max_blocks} columns")
        outside = [x for x in table[b][:needed] if not 0 <= x < num_blocks]
        if outside:
            raise ValueError(f"block_table[{b}] holds block {outside[0]} outside the pool's {num_blocks} blocks "
                             f"(block_table[{b}][:{needed}] = {table[b][:needed]})")
    _check_runnable(q.device, "paged_attention", "paged_reference_attention")
    return lengths, tokens
