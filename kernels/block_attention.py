"""Batch-invariant attention: each query's output bitwise the same whatever step, rows or cache it comes with.

A query at position p sees exactly one key per position 0..p (its prefix, then its ancestors in the step: the
pattern's rule gives every token a path), so its keys can be laid out by absolute position whatever the step looks
like. They are reduced in blocks of `BLOCK` positions aligned to position 0, in position order:
- scores per block by a batch-invariant GEMM (`row_plans.invariant_matmul`, every block the same [BLOCK] shape);
- the softmax's max over every visible score (a max is exact in any order), masked keys as -inf (their weight an
  exact 0);
- each block's weighted values and weight sum by one batch-invariant GEMM against [V | 1];
- the blocks' partial sums added one after another by `cumsum` (a sequential scan), then divided.
So the order of every floating-point operation a query's output comes from depends on its position alone. Blocks past
a query's last one, and its block's positions past p, add exact zeros.

Keys reach a query by two routes, computed alike: blocks every query of a row shares (its prefix's whole blocks; for
a row whose step is a path, a prompt chunk or a plain step, every block), gathered once per row, and each query's own
tail (the rest of its prefix's last block, then its ancestors), gathered per query. All arithmetic is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .row_plans import invariant_matmul

BLOCK = 16  # positions per reduction block


@dataclass
class RowKeys:
    """Where one row's queries find their keys: `shared` [S * BLOCK] slots of positions 0.. (every query of the row
    sees them where `shared_valid` [R, S * BLOCK] says, None: all), `tail` [R, U * BLOCK] each query's own slots
    (None: no tails) and `tail_valid` [R, U * BLOCK]."""

    shared: torch.Tensor
    shared_valid: torch.Tensor | None
    tail: torch.Tensor | None
    tail_valid: torch.Tensor | None


def row_keys(length: int, visible: torch.Tensor, slot_of, scratch: int, device) -> RowKeys:
    """The keys of a row whose step starts at position `length`: its prefix's whole blocks shared, the rest per query.
    visible: [T, T] bool, which step tokens each step token sees (in step order, which is position order: a token's
    ancestors come before it); slot_of: positions -> slots (int64 tensors); scratch: a slot for the tails' padding."""
    t = visible.shape[0]
    base = length // BLOCK * BLOCK
    counts = visible.sum(1)
    width = -(-int((length - base + counts).max()) // BLOCK) * BLOCK
    tail = torch.full((t, width), scratch, dtype=torch.int64)
    valid = torch.zeros(t, width, dtype=torch.bool)
    prefix_rest = slot_of(torch.arange(base, length))
    step_slots = slot_of(length + torch.arange(t))
    for i in range(t):
        own = torch.cat([prefix_rest, step_slots[visible[i]]])
        tail[i, : own.numel()] = own
        valid[i, : own.numel()] = True
    return RowKeys(slot_of(torch.arange(base)).to(device), None, tail.to(device), valid.to(device))


def path_keys(length: int, tokens: int, slot_of, device) -> RowKeys:
    """The keys of a row whose `tokens` step tokens are a path (a prompt chunk, a plain step: token i sees the prefix
    and tokens 0..i): every block shared, each query masked past its own position."""
    width = -(-(length + tokens) // BLOCK) * BLOCK
    positions = torch.arange(width)
    shared = slot_of(positions.clamp(max=length + tokens - 1))
    valid = positions[None, :] <= length + torch.arange(tokens)[:, None]
    return RowKeys(shared.to(device), valid.to(device), None, None)


def single_keys(lengths: list[int], slots_of: list, scratch: int, device) -> RowKeys:
    """The keys of one-token steps of several rows taken together, each query its own row's positions 0..L as a tail
    (padded to the longest; padding adds exact zeros): one call for every plain step of a packed step."""
    width = -(-(max(lengths) + 1) // BLOCK) * BLOCK
    tail = torch.full((len(lengths), width), scratch, dtype=torch.int64)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, (length, slot_of) in enumerate(zip(lengths, slots_of, strict=True)):
        tail[i, : length + 1] = slot_of(torch.arange(length + 1))
        valid[i, : length + 1] = True
    return RowKeys(torch.zeros(0, dtype=torch.int64, device=device), None, tail.to(device), valid.to(device))


def query_slots(keys: RowKeys, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same keys as one list per query, for `invariant_triton.invariant_attention`: (slots [R, width], counts
    [R]), query i's key slots in position order in slots[i, :counts[i]] (the shared blocks' valid part, then its
    tail's)."""
    shared = keys.shared[None].expand(rows, -1)
    shared_count = (keys.shared_valid.sum(1) if keys.shared_valid is not None
                    else torch.full((rows,), keys.shared.numel(), device=keys.shared.device))
    if keys.tail is None:
        return shared, shared_count
    return torch.cat([shared, keys.tail], dim=1), shared_count + keys.tail_valid.sum(1)


def block_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, keys: RowKeys,
                    scale: float | None = None) -> torch.Tensor:
    """One row's queries q [R, Hq, D] over the keys and values k_all, v_all [Hkv, slots, D] that `keys` names; returns
    [R, Hq, D] in q's dtype (see the module docstring for the order of operations)."""
    r, heads, dim = q.shape
    kv_heads = k_all.shape[0]
    group = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    q32 = (q.float() * scale).view(r, kv_heads, group, dim).permute(1, 0, 2, 3)  # [Hkv, R, G, D]
    blocks = keys.shared.numel() // BLOCK
    scores, valid = [], []
    if blocks:  # the shared blocks for all the row's (query, head) pairs at once
        k_shared = k_all[:, keys.shared].float().view(kv_heads, blocks, BLOCK, dim)
        v_shared = _with_ones(v_all[:, keys.shared].float().view(kv_heads, blocks, BLOCK, dim))
        scores.append(invariant_matmul(q32.reshape(kv_heads, 1, r * group, dim), k_shared.transpose(-1, -2),
                                       "scores").view(kv_heads, blocks, r, group, BLOCK).permute(0, 2, 3, 1, 4))
        valid.append(keys.shared_valid.view(r, 1, blocks, BLOCK) if keys.shared_valid is not None
                     else torch.ones(1, 1, blocks, BLOCK, dtype=torch.bool, device=q.device).expand(r, 1, blocks,
                                                                                                     BLOCK))
    if keys.tail is not None:
        tails = keys.tail.shape[1] // BLOCK
        k_tail = k_all[:, keys.tail].float().view(kv_heads, r, tails, BLOCK, dim)
        scores.append(invariant_matmul(q32[:, :, None], k_tail.transpose(-1, -2), "scores")
                      .permute(0, 1, 3, 2, 4))  # each tail block per query: [Hkv, R, G, U, BLOCK]
        valid.append(keys.tail_valid.view(r, 1, tails, BLOCK))
    scores = torch.cat(scores, dim=3)
    valid = torch.cat(valid, dim=2)[None]  # [1, R, 1, S + U, BLOCK]
    scores = scores.masked_fill(~valid, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(-1, -2), keepdim=True))  # masked keys: exactly 0
    sums = []  # weighted values and weight sums: [Hkv, R, G, blocks, D + 1]
    if blocks:
        shared = weights[:, :, :, :blocks].permute(0, 3, 1, 2, 4).reshape(kv_heads, blocks, r * group, BLOCK)
        sums.append(invariant_matmul(shared, v_shared, "values").view(kv_heads, blocks, r, group, dim + 1)
                    .permute(0, 2, 3, 1, 4))
    if keys.tail is not None:
        v_tail = v_all[:, keys.tail].float().view(kv_heads, r, tails, BLOCK, dim)
        v_tail = _with_ones(v_tail.masked_fill(~keys.tail_valid.view(1, r, tails, BLOCK, 1), 0.0))
        sums.append(invariant_matmul(weights[:, :, :, blocks:].permute(0, 1, 3, 2, 4), v_tail, "values")
                    .permute(0, 1, 3, 2, 4))
    total = torch.cat(sums, dim=3).cumsum(dim=3)[:, :, :, -1]  # block after block, in position order
    out = total[..., :dim] / total[..., dim:]
    return out.permute(1, 0, 2, 3).reshape(r, heads, dim).to(q.dtype)


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """[..., BLOCK, D] -> [..., BLOCK, D + 1]: a column of ones, so the GEMM of the weights gives their sum too."""
    return torch.cat([v, torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)], dim=-1)
