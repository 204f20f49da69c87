"""`KVPool`: the paged KV cache's memory, every layer's keys and values in fixed-size blocks, as a module of
non-persistent buffers. Which block belongs to whom is `paging.BlockPool`'s business; this holds the tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


def _bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.2f} MiB"


@dataclass(frozen=True)
class KVShape:
    """What one position holds in the cache: in each of `layers` layers, `kv_heads` keys and values of `head_dim`."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        """A model's (its config's `num_hidden_layers`, `num_key_value_heads`, `head_dim`)."""
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)

    def bytes(self, dtype: torch.dtype, positions: int) -> int:
        """Bytes of keys and values for `positions` positions of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * positions * torch.empty((), dtype=dtype).element_size()


class KVPool(nn.Module):
    """k, v [layers, Hkv, (blocks + 1) x block_size, D]: position p of a block b is slot b x block_size + p. The last
    block is scratch, owned by no row: a static step's padding tokens write their entries there.

    A layer's buffer is [Hkv, slots, D]; `blocks(layer)` views it as [blocks, Hkv, block_size, D], the layout the
    paged kernel reads through block tables. Writes and moves take device index tensors (no host value decides a
    shape), so a captured CUDA graph can replay them; stacking the layers lets one gather move a step's accepted
    entries in all of them.
    """

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.block_size, self.num_blocks = block_size, num_blocks + 1  # the rows' blocks, then the scratch one
        self.scratch_slot = num_blocks * block_size
        need = shape.bytes(dtype, self.num_blocks * block_size)
        free = free_bytes(torch.device(device))
        if free is not None and need > free:
            raise ValueError(f"the KV cache of {num_blocks} blocks of {block_size} positions needs "
                             f"{_bytes(need)} on {device}, where {_bytes(free)} are free: give fewer "
                             "prompts at once, a shorter prompt or fewer max_new_tokens (or call release() on models "
                             "you no longer use)")
        size = (shape.layers, shape.kv_heads, self.num_blocks * block_size, shape.head_dim)
        self.register_buffer("k", torch.zeros(size, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(size, dtype=dtype, device=device), persistent=False)
        assert math.prod(size) == self.k.numel()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [Hkv, T, D] at `slots` [T] of a layer; return the layer's buffers [Hkv, slots, D]."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer.index_copy_(1, slots, k)
        v_layer.index_copy_(1, slots, v)
        return k_layer, v_layer

    def blocks(self, buffer: torch.Tensor) -> torch.Tensor:
        """A layer's [Hkv, slots, D] buffer as [blocks, Hkv, block_size, D] (a view)."""
        heads, _, dim = buffer.shape
        return buffer.view(heads, self.num_blocks, self.block_size, dim).transpose(0, 1)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots `src` [K] to slots `dst` [K] in every layer (one gather, one scatter: every read happens before
        any write)."""
        for cache in (self.k, self.v):
            cache[:, :, dst] = cache[:, :, src]

    def entries(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys and values at `slots` [n] in every layer: [2, layers, Hkv, n, D]."""
        return torch.stack((self.k[:, :, slots], self.v[:, :, slots]))

    def put_entries(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Write `entries` [2, layers, Hkv, n, D] (as `entries` returns them) at `slots` [n]."""
        self.k[:, :, slots] = entries[0]
        self.v[:, :, slots] = entries[1]
