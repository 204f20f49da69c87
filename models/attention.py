"""How the layers of one forward pass attend: plain causal (a caller's own forward, no cache), or a packed step over the
paged KV cache through a backend.

A packed step lays every row's step tokens end to end ([ΣT]); each row has its own L, its own pattern (a lookahead
step, a plain step, a prompt chunk) and its own block table. A backend prepares once per step (`begin_step`) and
returns the per-layer function, which the layers call with no checks or re-derivation:
- "torch": gathers each row's keys and values through its table and runs SDPA over rows padded to a common length,
  with the rows' masks built once per step (rows of very different lengths, a prompt chunk beside one-token steps,
  go in separate groups, so nothing pads to the longest); a row whose slots are one run takes them as a view. It reads
  the lengths on the host, so a CUDA graph cannot replay it.
- "triton": `lookahead.kernels.PagedAttentionPlan`, which computes every row's pattern in the kernel from its (W, N,
  tree) and reads the cache through the block tables, all from device tensors, so a captured graph replays it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lookahead.kernels import StepPattern
from lookahead.kernels.block_attention import block_attention, path_keys, query_slots, row_keys, single_keys

from .kv_cache import KVPool

# layer, q [B, Hq, T, D], k and v [B, Hkv, T, D] (this layer's new entries) -> [B, Hq, T, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# layer, q [1, Hq, ΣT, D], that layer's whole pool buffers k_all and v_all [Hkv, slots, D] -> [1, Hq, ΣT, D]
LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SMALL_ROW = 32  # step tokens up to which rows share one padded SDPA call; a longer row (a prompt chunk) runs alone


def causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over the forward pass's own tokens (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


def invariant_causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal` in the batch-invariant mode: each row's queries by `block_attention` over its own keys in order."""
    t = q.shape[2]
    keys = path_keys(0, t, lambda positions: positions, q.device)
    return torch.stack([block_attention(q[b].transpose(0, 1), k[b], v[b], keys).transpose(0, 1)
                        for b in range(q.shape[0])])


class Paged:
    """`paged`'s per-layer function. It keeps its parts, so a forward that runs every layer in one call (the
    batch-invariant mode's CPU kernels, `models.invariant`) can take the pool, the write slots and the key lists
    instead of calling it layer by layer."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, attend: LayerAttention) -> None:
        self.pool, self.slots, self.attend = pool, slots, attend

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all, v_all = self.pool.write(layer, self.slots, k[0], v[0])
        return self.attend(layer, q, k_all, v_all)

    def cpu_kernel_inputs(self) -> tuple[KVPool, torch.Tensor, KeyLists] | None:
        """(pool, write slots, key lists) where the step attends through the CPU kernel's key lists (the runner's
        choice, by `Llama.uses_cpu_kernels`): what the layers in one call take; None for any other attention."""
        keys = self.attend
        return (self.pool, self.slots, keys) if isinstance(keys, KeyLists) and keys.kind == "cpu" else None


def paged(pool: KVPool, slots: torch.Tensor, attend: LayerAttention) -> Attend:
    """Write each layer's new K/V (of a packed step, [1, Hkv, ΣT, D]) at `slots` [ΣT] of the pool, then attend over
    the layer's pool."""
    return Paged(pool, slots, attend)


class KeyLists:
    """The invariant backend's per-layer function with a kernel: every attending query (`queries` [R], its packed
    index) over its own key slots (`slots` [R, W], the first `counts[r]` of row r in position order), in one call
    per layer; the other tokens (padding) get zeros. kind: the kernel's, "cpu" or "triton"."""

    def __init__(self, kind: str, queries: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> None:
        if kind == "cpu":
            from lookahead.kernels.cpu_kernels import attention as kernel
        else:
            from lookahead.kernels.invariant_triton import invariant_attention as kernel
        self.kind, self.kernel, self.queries, self.slots, self.counts = kind, kernel, queries, slots, counts

    def __call__(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(q)  # padding tokens: seen by no one
        out[0][:, self.queries] = self.kernel(q[0][:, self.queries].transpose(0, 1), k_all, v_all, self.slots,
                                              self.counts).transpose(0, 1)
        return out


@dataclass(frozen=True)
class PackedStep:
    """The host's description of a packed step: per row its L, its pattern (with its tree), its block table (the
    pool blocks of its positions 0, block_size, 2 block_size, ...) and its offset in the packed tokens; and the tokens
    fed in all."""

    lengths: Sequence[int]
    patterns: Sequence[StepPattern]
    tables: Sequence[Sequence[int]]
    starts: Sequence[int]
    block_size: int
    fed: int  # the tokens fed, padding included (a static step's padding follows the rows' tokens)

    @property
    def total(self) -> int:
        """The rows' tokens."""
        return self.starts[-1] + self.patterns[-1].num_tokens if self.patterns else 0


def row_mask(pattern: StepPattern, length: int, width: int) -> torch.Tensor:
    """[T, width] bool: a row's step tokens see its prefix (positions < L) and, within the step, what the pattern says;
    columns past L + T (padding) are never seen."""
    t = pattern.num_tokens
    mask = torch.zeros(t, width, dtype=torch.bool)
    mask[:, :length] = True
    idx = torch.arange(t)
    mask[:, length : length + t] = pattern.visible(idx[:, None], idx[None, :])
    return mask


class _Group:
    """Rows that share one SDPA call, padded to their longest step and their longest key span."""

    def __init__(self, step: PackedStep, rows: list[int], device: torch.device) -> None:
        tokens = [step.patterns[b].num_tokens for b in rows]
        spans = [step.lengths[b] + t for b, t in zip(rows, tokens, strict=True)]
        t_max, s_max, size = max(tokens), max(spans), step.block_size
        first = [step.starts[b] for b in rows]
        table = step.tables[rows[0]][: -(-s_max // size)]
        # one row whose blocks are one run of the pool, and whose tokens are the whole step: views, no gathers
        self.run = table[0] * size if len(rows) == 1 and _is_run(table) else None
        self.whole = len(rows) == 1 and tokens[0] == step.fed
        self.span = s_max
        if self.run is None:
            blocks = torch.tensor([list(step.tables[b][: -(-s_max // size)]) + [0] * (-(-s_max // size) - len(
                step.tables[b][: -(-s_max // size)])) for b in rows])
            slots = (blocks[:, :, None] * size + torch.arange(size)).flatten(1)[:, :s_max]  # [G, S_max]
            self.keys = slots.to(device)
        if not self.whole:  # [G, T_max] packed index of each padded query (padding repeats the row's last token)
            self.queries = torch.tensor([[s + min(j, t - 1) for j in range(t_max)]
                                         for s, t in zip(first, tokens, strict=True)], device=device)
        pattern, length = step.patterns[rows[0]], step.lengths[rows[0]]
        self.mask, self.causal = None, False
        if len(rows) == 1 and length == 0 and t_max > 1 and _is_path(pattern):
            self.causal = True  # a first prompt chunk: plain causal attention over itself
        elif len(rows) > 1 or t_max > 1:
            mask = torch.zeros(len(rows), 1, t_max, s_max, dtype=torch.bool)
            for g, b in enumerate(rows):
                mask[g, 0, : tokens[g]] = row_mask(step.patterns[b], step.lengths[b], s_max)
                mask[g, 0, tokens[g] :, 0] = True  # padding queries see one key: no row of NaNs
            self.mask = mask.to(device)
        # where each real query's output goes: its packed index, and its place in the padded [G x T_max]
        self.dst = torch.tensor([s + j for s, t in zip(first, tokens, strict=True) for j in range(t)], device=device)
        self.src = torch.tensor([g * t_max + j for g, t in enumerate(tokens) for j in range(t)], device=device)

    def attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        """q [1, Hq, ΣT, D] -> [Hq, n, D]: this group's real queries' outputs (n of them), in packed order."""
        if self.run is not None:
            k = k_all[None, :, self.run : self.run + self.span]
            v = v_all[None, :, self.run : self.run + self.span]
        else:
            k = k_all[:, self.keys].transpose(0, 1)  # [G, Hkv, S, D]
            v = v_all[:, self.keys].transpose(0, 1)
        queries = q if self.whole else q[0][:, self.queries].transpose(0, 1)  # [G, Hq, T, D]
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=self.mask, is_causal=self.causal,
                                             enable_gqa=True)
        if self.whole:
            return out[0]
        heads, dim = out.shape[1], out.shape[3]
        return out.transpose(0, 1).reshape(heads, -1, dim)[:, self.src]


class TorchBackend:
    """SDPA over each group of rows' gathered keys and values with the masks built once per step."""

    name, graphable = "torch", False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def resize(self, pool: KVPool, max_rows: int, row_tokens: Sequence[int]) -> None:
        pass  # nothing is sized ahead

    def begin_step(self, step: PackedStep, device_inputs=None) -> LayerAttention:
        small = [b for b, p in enumerate(step.patterns) if p.num_tokens <= SMALL_ROW]
        groups = ([small] if small else []) + [[b] for b, p in enumerate(step.patterns) if p.num_tokens > SMALL_ROW]
        groups = [_Group(step, rows, self.device) for rows in groups]

        def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            if len(groups) == 1 and groups[0].whole:
                return groups[0].attend(q, k_all, v_all)[None]
            out = torch.zeros_like(q) if step.fed > step.total else torch.empty_like(q)  # padding: seen by no one
            for group in groups:
                out[0][:, group.dst] = group.attend(q, k_all, v_all)
            return out

        return attend

    def end_step(self) -> None:
        pass


class TritonBackend:
    """The paged Triton kernel, launched per layer with the step's device tensors (the rows' offsets, lengths, W, N,
    trees and block tables) through one of two prepared plans: one sized for decoding steps, one for steps that carry
    a prompt chunk (a plan's row tile is fixed by the longest row it serves; each call's prefix splits follow its own
    rows and tokens)."""

    name, graphable = "triton", True

    def __init__(self, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self._shape = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, device=device)
        self.pool: KVPool | None = None
        self.plans: list = []  # (max row tokens, plan), smallest first

    def resize(self, pool: KVPool, max_rows: int, row_tokens: Sequence[int]) -> None:
        """Plans for steps of up to `max_rows` rows, one per limit on a row's tokens in `row_tokens`, over `pool`."""
        from lookahead.kernels import PagedAttentionPlan

        self.pool = pool
        self.plans = [(t, PagedAttentionPlan(**self._shape, max_rows=max_rows, max_row_tokens=t,
                                             max_len=pool.num_blocks * pool.block_size))
                      for t in sorted(set(row_tokens))]

    def begin_step(self, step: PackedStep, device_inputs) -> LayerAttention:
        longest = max((p.num_tokens for p in step.patterns), default=0)
        plan = next(plan for tokens, plan in self.plans if tokens >= longest)
        meta, pool = device_inputs, self.pool

        def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            out = plan(q[0].transpose(0, 1), pool.blocks(k_all), pool.blocks(v_all), meta["block_table"],
                       meta["cu_seqlens"], meta["prefix_len"], meta["window"], meta["ngram"], meta["tree_end"])
            return out.transpose(0, 1)[None]

        return attend

    def end_step(self) -> None:
        pass


class InvariantBackend:
    """The batch-invariant mode's attention (`Llama(batch_invariant=True)`): every query's keys reduced in position
    order by arithmetic that depends on its own keys alone, so its output does not depend on its step's shape, the rows
    beside it, how its prompt was chunked or whether its prefix came from the cache. The rows' key slots are laid out
    on the host once per step. Three reductions, each bitwise the same with itself: `kernel="triton"`
    (`lookahead.kernels.invariant_attention`, the Triton backend's), `"cpu"` (the compiled CPU kernel,
    `lookahead.kernels.cpu_kernels.attention`) and `"torch"` (`block_attention`, torch ops: elsewhere)."""

    name, graphable = "invariant", False

    def __init__(self, device: torch.device, kernel: str = "torch") -> None:
        if kernel not in ("triton", "cpu", "torch"):
            raise ValueError(f"kernel must be 'triton', 'cpu' or 'torch', got {kernel!r}")
        self.device = torch.device(device)
        self.kernel = kernel
        self.pool: KVPool | None = None

    def resize(self, pool: KVPool, max_rows: int, row_tokens: Sequence[int]) -> None:
        self.pool = pool  # for its scratch slot, which pads the tails

    def begin_step(self, step: PackedStep, device_inputs=None) -> LayerAttention:
        if self.kernel == "cpu" and step.patterns and all(p.num_tokens == 1 for p in step.patterns):
            return _single_lists(step)  # plain decoding: every row one token
        size, rows, singles = step.block_size, [], []
        for pattern, length, blocks, start in zip(step.patterns, step.lengths, step.tables, step.starts, strict=True):
            table = torch.tensor(blocks, dtype=torch.int64)

            def slot_of(positions: torch.Tensor, table: torch.Tensor = table) -> torch.Tensor:
                return table[positions // size] * size + positions % size

            t = pattern.num_tokens
            if t == 1:  # plain steps: all of them in one call below
                singles.append((start, length, slot_of))
            elif _is_path(pattern):
                rows.append((torch.arange(start, start + t), path_keys(length, t, slot_of, self.device)))
            else:
                index = torch.arange(t)
                rows.append((torch.arange(start, start + t), row_keys(
                    length, pattern.visible(index[:, None], index[None, :]), slot_of, self.pool.scratch_slot,
                    self.device)))
        if singles:
            starts, lengths, slots = zip(*singles, strict=True)
            rows.append((torch.tensor(starts), single_keys(list(lengths), list(slots), self.pool.scratch_slot,
                                                           self.device)))
        rows = [(queries.to(self.device), keys) for queries, keys in rows]
        if not rows:  # a step of padding alone (a capture's placeholder): seen by no one
            return lambda layer, q, k_all, v_all: torch.zeros_like(q)
        if self.kernel != "torch":
            return self._kernel_step(rows)

        def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(q)  # padding tokens: seen by no one
            for queries, keys in rows:
                out[0][:, queries] = block_attention(q[0][:, queries].transpose(0, 1), k_all, v_all,
                                                     keys).transpose(0, 1)
            return out

        return attend

    def _kernel_step(self, rows: list) -> LayerAttention:
        """Every row's queries in one call per layer: each query's key slots as one padded list."""
        index = torch.int64 if self.kernel == "cpu" else torch.int32  # as the kernel reads them: once a step
        lists = [query_slots(keys, queries.numel()) for queries, keys in rows]
        width = max(slots.shape[1] for slots, _ in lists)
        slots = torch.cat([F.pad(s, (0, width - s.shape[1])) for s, _ in lists]).to(index)
        counts = torch.cat([c for _, c in lists]).to(index)
        return KeyLists(self.kernel, torch.cat([q for q, _ in rows]), slots, counts)

    def end_step(self) -> None:
        pass


def _single_lists(step: PackedStep) -> KeyLists:
    """The CPU kernel's key lists of a step whose rows each feed one token (plain decoding), built in numpy: row i's
    query sees its positions 0..L through its block table, the lists `single_keys` and `query_slots` give (their
    padding aside, which the kernel does not read), at a tenth of their torch ops' cost."""
    size, lengths = step.block_size, np.asarray(step.lengths, dtype=np.int64)
    slots = np.zeros((len(lengths), int(lengths.max()) + 1), dtype=np.int64)
    for i, (length, blocks) in enumerate(zip(step.lengths, step.tables, strict=True)):
        positions = np.arange(length + 1)
        slots[i, : length + 1] = np.asarray(blocks, dtype=np.int64)[positions // size] * size + positions % size
    return KeyLists("cpu", torch.tensor(step.starts, dtype=torch.int64), torch.from_numpy(slots),
                    torch.from_numpy(lengths + 1))


def _is_run(blocks: Sequence[int]) -> bool:
    """Whether the blocks are consecutive in the pool (their slots one run)."""
    return all(b - a == 1 for a, b in zip(blocks, blocks[1:], strict=False))


def _is_path(pattern: StepPattern) -> bool:
    """Whether the step is a prompt chunk's: one token and a path of nodes under it (causal over the step)."""
    return pattern.lookahead_len == 1 and pattern.tree_end is not None and all(
        end == len(pattern.tree_end) for end in pattern.tree_end)
