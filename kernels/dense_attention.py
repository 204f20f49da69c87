"""The classic dense contract on the paged kernel (`triton_attention.PagedAttentionPlan`): `StepAttentionPlan` (a
model's pre-checked launch of one step shape) and `lookahead_attention` (public, every input checked).

The dense layout is the paged one with one block of S positions per row (block_table[b] = [b]) and every row the same
step; chains are their tree.
"""

from __future__ import annotations

import torch

from .pattern import StepPattern, check_tree_end
from .triton_attention import (
    _MAX_HEAD_DIM,
    PagedAttentionPlan,
    Rows,
    _check_are_tensors,
    _check_dtype,
    _check_int,
    _check_integer_tensor,
    _check_runnable,
    _check_sm_scale,
)

__all__ = ["StepAttentionPlan", "lookahead_attention"]


class StepAttentionPlan:
    """Launches of one step's attention over a dense cache for fixed shapes: checked once, then called per layer with
    no checks. A thin layer over `PagedAttentionPlan`: row b's cache is block b of S positions, its tokens rows
    b T .. b T + T - 1 of q viewed as [B T, Hq, D], every row the pattern's (W, N); chains are their tree."""

    def __init__(self, pattern: StepPattern, *, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_len: int, sm_scale: float | None = None,
                 num_splits: int | None = None) -> None:
        """max_len: the most prefix positions any call will have (the cache capacity); the split count is chosen
        from it (fixed for a CUDA graph) unless num_splits is given."""
        if not isinstance(pattern, StepPattern):
            raise TypeError(f"pattern must be a StepPattern, got {type(pattern).__name__}")
        _check_int("batch", batch, 1)
        self.pattern, self.batch, self.tokens = pattern, batch, pattern.num_tokens
        self.plan = PagedAttentionPlan(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
                                       device=device, max_rows=batch, max_row_tokens=max(1, self.tokens),
                                       max_len=max_len, sm_scale=sm_scale, num_splits=num_splits)
        self.num_splits = self.plan.num_splits
        tree = pattern.node_ends
        self._tree = tree or (0,)
        self._constants: tuple[torch.Tensor, ...] = ()

    def _device_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """cu_seqlens, block table, W, N and the pattern's own tree on q's device, made on the first call (a warm-up
        run before any graph capture; a plan is called on one device): a dense batch is B rows of T tokens, row b's
        cache in block b."""
        if not self._constants or self._constants[0].device != device:
            batch, tokens, p = self.batch, self.tokens, self.pattern
            ints = dict(dtype=torch.int32, device=device)
            self._constants = (torch.arange(batch + 1, **ints) * tokens, torch.arange(batch, **ints)[:, None],
                               torch.full((batch,), p.window, **ints), torch.full((batch,), p.ngram, **ints),
                               torch.tensor(self._tree, dtype=torch.int64, device=device))
        return self._constants

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                 tree_end: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, T, D] any strides (free when it is a transposed view of a contiguous [B, T, Hq, D]); k, v
        [B, Hkv, S, D] any strides, S >= max_len + T; prefix_len int64 [B] on the device; tree_end (tree plans) [V]
        or [B, V] on the device, default the pattern's. Returns [B, Hq, T, D], a transposed view of a contiguous
        [B, T, Hq, D]."""
        batch, tokens = self.batch, self.tokens
        cu_seqlens, table, window, ngram, own_tree = self._device_constants(q.device)
        if tree_end is None or not self.pattern.is_tree:
            tree_end, strides = own_tree, (0, 0, own_tree.stride(0))
        elif tree_end.ndim == 2:
            strides = (tree_end.stride(0), 0, tree_end.stride(1))
        else:
            strides = (0, 0, tree_end.stride(0))
        packed = q.transpose(1, 2).reshape(batch * tokens, q.shape[1], q.shape[3])
        out = self.plan._launch(packed, k, v, Rows(table, cu_seqlens, prefix_len, window, ngram, tree_end), strides)
        return out.view(batch, tokens, q.shape[1], q.shape[3]).transpose(1, 2)


def _check_tensors(q, k, v) -> None:
    """q, k, v: tensors of the dense layout whose batch, heads and head dim agree (the public entry's first checks)."""
    _check_are_tensors({"q": q, "k": k, "v": v})
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q, k, v must be 4-D [B, H, T, D] / [B, Hkv, S, D] with k.shape == v.shape; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads_q, _, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v batch and head dim must match q's ({batch}, {head_dim}); got k {tuple(k.shape)}")
    if head_dim == 0:
        raise ValueError(f"head dim must be >= 1, got q {tuple(q.shape)}")
    if heads_q == 0 or k.shape[1] == 0:
        raise ValueError(f"q and k/v need at least one head; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if heads_q % k.shape[1] != 0:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of KV heads ({k.shape[1]})")


def _step_pattern(q: torch.Tensor, window, ngram, guesses, tree_end) -> StepPattern:
    """The step's pattern (chains of `guesses` candidates, or the tree of `tree_end`), checked against q's tokens."""
    batch, tokens = q.shape[0], q.shape[2]
    if tree_end is None:
        pattern = StepPattern(window, ngram, guesses)  # checks W >= 1, N >= 2, g >= 0 and their types
        trees = None
    else:
        if not isinstance(tree_end, torch.Tensor):
            raise TypeError(f"tree_end must be an integer tensor [V] or [B, V] or None, got {type(tree_end).__name__}")
        width = tree_end.shape[-1] if tree_end.ndim else -1
        _check_integer_tensor("tree_end", tree_end, q.device, [(width,), (batch, width)])
        trees = tree_end.reshape(-1, width).tolist() if width else [[]] * (batch if tree_end.ndim == 2 else 1)
        for row, ends in enumerate(trees):
            check_tree_end(ends, "tree_end" if tree_end.ndim == 1 else f"tree_end[{row}]")
        pattern = StepPattern(window, ngram, 0, tuple(trees[0]) if trees else ())
    form = (f"W={window}, N={ngram}, V={pattern.verify_len} needs W(N - 1) + V" if trees is not None
            else f"W={window}, N={ngram}, g={guesses} needs (W + g) * (N - 1)")
    if tokens != pattern.num_tokens:
        raise ValueError(f"q has {tokens} tokens; {form} = {pattern.num_tokens}")
    return pattern


def _prefix_lengths(q: torch.Tensor, k: torch.Tensor, prefix_len) -> list[int]:
    """Each row's prefix length, checked against k/v's positions."""
    batch, tokens = q.shape[0], q.shape[2]
    if isinstance(prefix_len, torch.Tensor):
        _check_integer_tensor("prefix_len", prefix_len, q.device, [(batch,)])
        lengths = prefix_len.tolist()
    elif isinstance(prefix_len, bool) or not isinstance(prefix_len, int):
        raise ValueError(f"prefix_len must be an int >= 0 or an integer tensor [B], got {prefix_len!r}")
    else:
        lengths = [prefix_len] * batch
    if any(n < 0 for n in lengths):
        raise ValueError(f"prefix_len must be an int >= 0 (per row), got {lengths if len(lengths) > 1 else lengths[0]}")
    if lengths and max(lengths) + tokens > k.shape[2]:
        raise ValueError(f"k/v hold {k.shape[2]} positions but prefix_len + T = {max(lengths)} + {tokens} = "
                         f"{max(lengths) + tokens}")
    return lengths


def _check_runs_here(q, k, v, sm_scale) -> None:
    """What the kernel runs: a dtype, one device, a head dim and a scale it supports."""
    _check_dtype(q.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.shape[3] > _MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[3]} is larger than the kernel's maximum {_MAX_HEAD_DIM}")
    _check_runnable(q.device, "lookahead_attention", "reference_attention")
    _check_sm_scale(sm_scale)


def lookahead_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int | torch.Tensor,
    window: int,
    ngram: int,
    guesses: int,
    sm_scale: float | None = None,
    *,
    tree_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one lookahead decoding step, its pattern computed in the kernel (no mask tensor).

    Args:
        q: [B, Hq, T, D] the step's queries in docs/DESIGN.md's layout, any strides.
        k, v: [B, Hkv, S, D]: row b holds its cache prefix (positions < prefix_len[b]) followed by the step's T
            keys/values; only those are read, so a preallocated cache buffer can be passed as it is. Hq % Hkv == 0.
        prefix_len: L, an int (every row) or an integer tensor [B] on q's device (per-row lengths).
        window, ngram: W >= 1 and N >= 2.
        guesses: chains form: g >= 0, the candidates present; T = (W + g)(N - 1). Ignored in tree form.
        sm_scale: softmax scale, default 1 / sqrt(D).
        tree_end: None (chains) or an integer tensor [V] or [B, V] on q's device: node j's subtree ends before
            tree_end[j] (docs/DESIGN.md's tree form); T = W(N - 1) + V.

    Returns:
        [B, Hq, T, D] in q's dtype (float16, bfloat16 or float32): a transposed view of a contiguous [B, T, Hq, D].
    """
    _check_tensors(q, k, v)  # every check here, in this order: the first fault is the one named
    pattern = _step_pattern(q, window, ngram, guesses, tree_end)
    lengths = _prefix_lengths(q, k, prefix_len)
    _check_runs_here(q, k, v, sm_scale)
    batch, heads_q, tokens, head_dim = q.shape
    if batch == 0 or tokens == 0:
        return torch.empty(batch, tokens, heads_q, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    if isinstance(prefix_len, torch.Tensor):
        prefix_len = prefix_len.to(torch.int64).contiguous()
    else:
        prefix_len = torch.full((batch,), prefix_len, dtype=torch.int64, device=q.device)
    if tree_end is not None:
        tree_end = tree_end.to(torch.int64).contiguous()
    plan = StepAttentionPlan(pattern, batch=batch, heads_q=heads_q, heads_kv=k.shape[1], head_dim=head_dim,
                             dtype=q.dtype, device=q.device, max_len=max(lengths), sm_scale=sm_scale)
    return plan(q, k, v, prefix_len, tree_end)
