"""The preallocated KV cache of all layers, as a module of non-persistent buffers."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of every layer: k, v [layers, B, Hkv, capacity, D].

    Writes and moves take device index tensors (no host value decides a shape), so a captured CUDA
    graph can replay them; stacking the layers lets one gather move a step's accepted entries in all
    of them.
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

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at positions `slots` [T] of `layer`; return that layer's buffers."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer.index_copy_(2, slots, k)
        v_layer.index_copy_(2, slots, v)
        return k_layer, v_layer

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy positions `src` [K] to positions `dst` [K] in every layer (all reads happen before the writes)."""
        for cache in (self.k, self.v):
            cache.index_copy_(3, dst, cache.index_select(3, src))
