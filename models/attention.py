"""How the layers of one forward pass attend: plain causal, a causal prefill into the cache, or a
lookahead step through a backend.

A backend prepares once per step (`begin_step`) and returns the per-layer function; the layers call
it with no checks or re-derivation. "torch" runs SDPA over the first L + T keys with the step's dense
mask, written into a preallocated buffer (on CPU the fastest choice for a few hundred query rows; it
reads L on the host, so it cannot be replayed by a CUDA graph). "triton" runs the kernel's prepared
plan, which reads L from a device tensor, so a captured graph replays it at any L.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lookahead.kernels import StepAttentionPlan, StepPattern, masked_attention

from .kv_cache import KVCache

BACKENDS = ("auto", "torch", "triton")

# layer, q [B, Hq, T, D], k and v [B, Hkv, T, D] (this layer's new entries) -> [B, Hq, T, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# layer, q, that layer's whole cache buffers k_all and v_all [B, Hkv, capacity, D] -> [B, Hq, T, D]
LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over the forward pass's own tokens (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


def cached(cache: KVCache, slots: torch.Tensor, attend: LayerAttention) -> Attend:
    """Write each layer's new K/V at positions `slots` [T], then attend over the layer's cache."""

    def layer_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all, v_all = cache.write(layer, slots, k, v)
        return attend(layer, q, k_all, v_all)

    return layer_attention


def prefill_attention(prefix_len: int) -> LayerAttention:
    """Causal attention of a prefill written after `prefix_len` cached positions."""

    def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        end = prefix_len + t
        if prefix_len == 0:
            return causal(layer, q, k_all[:, :, :t], v_all[:, :, :t])
        mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(prefix_len)
        return masked_attention(q, k_all, v_all, prefix_len, mask)

    return attend


class TorchBackend:
    """SDPA with the step's dense mask in a preallocated [max_tokens, capacity] buffer.

    The buffer's columns stay True except a step's own T x T block, which is written before the
    forward and reset after it (`end_step`), so no per-step allocation grows with the sequence.
    A chains block is built once per pattern; a tree block every step, from the step's tree_end.
    """

    graphable = False

    def __init__(self, capacity: int, max_tokens: int, device: torch.device) -> None:
        self._mask = torch.ones(max_tokens, capacity, dtype=torch.bool, device=device)
        self._step_masks: dict[StepPattern, torch.Tensor] = {}
        self._block: torch.Tensor | None = None

    def begin_step(self, pattern: StepPattern, prefix_len: int, lengths: torch.Tensor,
                   tree_end: torch.Tensor | None = None) -> LayerAttention:
        """tree_end: tree form, this step's [V] on the device (the pattern stands for the shape only)."""
        t = pattern.num_tokens
        mask = None
        if t > 1:
            self._block = self._mask[:t, prefix_len : prefix_len + t]
            if pattern.is_tree:
                idx = torch.arange(t, device=self._mask.device)
                self._block.copy_(pattern.visible(idx[:, None], idx[None, :], tree_end))
            else:
                if pattern not in self._step_masks:
                    self._step_masks[pattern] = pattern.materialize(0, device=self._mask.device)
                self._block.copy_(self._step_masks[pattern])
            mask = self._mask[:t, : prefix_len + t]

        def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            return masked_attention(q, k_all, v_all, prefix_len, mask)

        return attend

    def end_step(self) -> None:
        if self._block is not None:
            self._block.fill_(True)  # these columns are prefix for the next step
            self._block = None


class TritonBackend:
    """The Triton kernel through one prepared plan per step shape (checked once, launched per layer); a tree
    comes with each call, as data."""

    graphable = True

    def __init__(self, batch: int, heads_q: int, heads_kv: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self._shape = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
                           device=device, max_len=capacity)
        self._plans: dict[tuple, StepAttentionPlan] = {}

    def begin_step(self, pattern: StepPattern, prefix_len: int, lengths: torch.Tensor,
                   tree_end: torch.Tensor | None = None) -> LayerAttention:
        """tree_end: tree form, this step's [V] on the device (the pattern stands for the shape only)."""
        if pattern.shape not in self._plans:
            self._plans[pattern.shape] = StepAttentionPlan(pattern, **self._shape)
        plan = self._plans[pattern.shape]

        def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            return plan(q, k_all, v_all, lengths, tree_end)

        return attend

    def end_step(self) -> None:
        pass
