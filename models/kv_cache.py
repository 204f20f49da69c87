"""The preallocated KV cache of all layers, as a module of non-persistent buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lookahead.kernels import commit_accepted


class KVCache(nn.Module):
    """Keys and values of every layer: k, v [layers, B, Hkv, capacity, D].

    Stacking the layers lets one copy commit a step's accepted entries in all of them.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def capacity(self) -> int:
        """Positions each layer holds."""
        return self.k.shape[3]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at positions start..start+T-1 of `layer`; return that layer's buffers."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; writing {start}..{end - 1} overflows it")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer], self.v[layer]

    def commit(self, prefix_len: int, step_indices: Sequence[int]) -> None:
        """Move a step's accepted entries (step indices) to positions prefix_len.. in every layer."""
        commit_accepted(self.k, self.v, prefix_len, step_indices)
