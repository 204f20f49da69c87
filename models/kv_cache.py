"""The preallocated KV cache of all layers, as a module of non-persistent buffers."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can take: CUDA's free memory plus what torch's caching allocator holds
    unused; on a CPU the kernel's MemAvailable; None where neither is known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class KVCache(nn.Module):
    """Keys and values of every layer: k, v [layers, B, Hkv, capacity, D], one row per sequence.

    Writes and moves take device index tensors (no host value decides a shape), so a captured CUDA
    graph can replay them; stacking the layers lets one gather move a step's accepted entries in all
    of them. A step of b < B sequences uses rows 0..b-1.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (layers, batch, kv_heads, capacity, head_dim)
        need = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        free = free_bytes(torch.device(device))
        if free is not None and need > free:
            raise ValueError(f"the KV cache for {batch} sequence(s) of {capacity} positions needs "
                             f"{need / 2**30:.1f} GiB on {device}, where {free / 2**30:.1f} GiB are free: give fewer "
                             "prompts at once, a "
                             "shorter prompt or fewer max_new_tokens (or call release() on models you no longer use)")
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def capacity(self) -> int:
        """Positions each layer holds."""
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        """Sequences (rows) it holds."""
        return self.k.shape[1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: slice = slice(None), batch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, Hkv, T, D] in cache rows `rows` (b of them) at positions `slots`: [T], the same for
        every row, or [b, T], each row's own (then `batch` may give `row_index(slots)`, made once for all layers).
        Return those rows of the layer's buffers, [b, Hkv, capacity, D]."""
        k_layer, v_layer = self.k[layer, rows], self.v[layer, rows]
        if slots.ndim == 1:
            k_layer.index_copy_(2, slots, k)
            v_layer.index_copy_(2, slots, v)
        else:  # per-row positions: one scatter over (row, position) pairs
            batch = row_index(slots) if batch is None else batch
            k_layer[batch, :, slots] = k.transpose(1, 2)  # the indexed view is [b, T, Hkv, D]
            v_layer[batch, :, slots] = v.transpose(1, 2)
        return k_layer, v_layer

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In each row b < src.shape[0], copy positions src[b] [K] to dst[b] [K] in every layer (one gather,
        one scatter: every read happens before any write)."""
        batch = torch.arange(src.shape[0], device=src.device)[:, None]
        for cache in (self.k, self.v):
            cache[:, batch, :, dst] = cache[:, batch, :, src]

    def entries(self, positions: torch.Tensor, row: int = 0) -> torch.Tensor:
        """Keys and values at `positions` [n] of row `row` in every layer: [2, layers, Hkv, n, D]."""
        return torch.stack((self.k[:, row, :, positions], self.v[:, row, :, positions]))

    def put_entries(self, positions: torch.Tensor, entries: torch.Tensor, row: int = 0) -> None:
        """Write `entries` [2, layers, Hkv, n, D] (as `entries` returns them) at `positions` [n] of row `row`."""
        self.k[:, row, :, positions] = entries[0]
        self.v[:, row, :, positions] = entries[1]

    def keep_rows(self, order: list[int], upto: int) -> None:
        """Row i takes the contents of row order[i] (positions < upto only: nothing past them is read again).
        Rows already in place are not copied, so dropping a finished row by moving the last one into its
        place costs one row's copy."""
        moved = [(i, r) for i, r in enumerate(order) if i != r]
        if not moved:
            return
        dst = torch.tensor([i for i, _ in moved], device=self.k.device)
        src = torch.tensor([r for _, r in moved], device=self.k.device)
        for cache in (self.k, self.v):
            prefix = cache[:, :, :, :upto]
            prefix.index_copy_(1, dst, prefix.index_select(1, src))


def row_index(slots: torch.Tensor) -> torch.Tensor:
    """[b, 1]: the row of each of per-row `slots` [b, T], to index a cache's rows with them."""
    return torch.arange(slots.shape[0], device=slots.device)[:, None]
