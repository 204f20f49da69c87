"""Batch-invariant attention: each query's output bitwise the same whatever step, rows or cache it comes with.

A query at position p sees exactly one key per position 0..p (its prefix, then its ancestors in the step: the
pattern's rule gives every token a path), so its keys can be laid out by absolute position whatever the step looks
like. They are reduced in blocks of `BLOCK` positions aligned to position 0, in position order:
- scores per block by a batch-invariant GEMM (`row_plans.invariant_matmul`, every block the same [BLOCK] shape);
- the softmax's max over every visible score (a max is exact in any order), masked keys as -inf (their weight an
  exact 0);
- each block's weighted values and weight sum by one batch-invariant GEMM against [V | 1];
- the blocks' partial sums added one after another in float32, then divided.
So the order of every floating-point operation a query's output comes from depends on its position alone. Blocks past
a query's last one, and its block's positions past p, add exact zeros.

Keys reach a query by two routes, computed alike: blocks every query of a row shares (its prefix's whole blocks; for
a row whose step is a path, a prompt chunk or a plain step, every block), gathered once per row, and each query's own
tail (the rest of its prefix's last block, then its ancestors), gathered per query. All arithmetic is float32.

`RowKeys` (built by `row_keys`, `path_keys`, `single_keys`) says where a row's queries find their keys; `query_slots`
turns it into the per-query lists that the kernels of the same contract take (`invariant_triton.invariant_attention`;
on the CPU `cpu_kernels.attention`, every sum a fused multiply-add chain in position order, without blocks).
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
    shared, tails = keys.shared.numel() // BLOCK, 0 if keys.tail is None else keys.tail.shape[1] // BLOCK
    maxima = []
    if shared:  # the shared blocks for all the row's (query, head) pairs at once: [Hkv, S, R, G, BLOCK]
        k = k_all[:, keys.shared].float().view(kv_heads, shared, BLOCK, dim)
        s_shared = invariant_matmul(q32.reshape(kv_heads, 1, r * group, dim), k.transpose(-1, -2), "scores")
        s_shared = s_shared.view(kv_heads, shared, r, group, BLOCK)
        if keys.shared_valid is not None:
            hidden = ~keys.shared_valid.view(r, shared, BLOCK).transpose(0, 1)[None, :, :, None]
            s_shared = s_shared.masked_fill(hidden, float("-inf"))
        maxima.append(s_shared.amax(dim=(1, 4)))
    if tails:  # each query's own blocks: [Hkv, R, U, G, BLOCK]
        k = k_all[:, keys.tail].float().view(kv_heads, r, tails, BLOCK, dim)
        s_tail = invariant_matmul(q32[:, :, None], k.transpose(-1, -2), "scores")
        hidden = ~keys.tail_valid.view(r, tails, BLOCK)
        s_tail = s_tail.masked_fill(hidden[None, :, :, None], float("-inf"))
        maxima.append(s_tail.amax(dim=(2, 4)))
    top = maxima[0] if len(maxima) == 1 else torch.maximum(*maxima)  # [Hkv, R, G]: exact in any order
    partials = []  # each block's weighted values and weight sum, [Hkv, R, G, D + 1], in position order
    if shared:
        v = _with_ones(v_all[:, keys.shared].float().view(kv_heads, shared, BLOCK, dim))
        weights = torch.exp(s_shared - top[:, None, :, :, None])  # masked keys: exactly 0
        sums = invariant_matmul(weights.view(kv_heads, shared, r * group, BLOCK), v, "values")
        sums = sums.view(kv_heads, shared, r, group, dim + 1)
        partials += [sums[:, b] for b in range(shared)]
    if tails:
        v = v_all[:, keys.tail].float().view(kv_heads, r, tails, BLOCK, dim)
        v = _with_ones(v.masked_fill(hidden[None, :, :, :, None], 0.0))  # padding slots may hold anything
        weights = torch.exp(s_tail - top[:, :, None, :, None])
        sums = invariant_matmul(weights, v, "values")  # [Hkv, R, U, G, D + 1]
        partials += [sums[:, :, u] for u in range(tails)]
    total = partials[0]
    for partial in partials[1:]:  # block after block, in float32: a query's blocks past its own add exact zeros
        total = total + partial
    out = total[..., :dim] / total[..., dim:]
    return out.permute(1, 0, 2, 3).reshape(r, heads, dim).to(q.dtype)


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """[..., BLOCK, D] -> [..., BLOCK, D + 1]: a column of ones, so the GEMM of the weights gives their sum too."""
    return torch.cat([v, torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)], dim=-1)
