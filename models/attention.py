"""How the layers of one forward pass attend: plain causal, a causal prefill into the cache, or a
lookahead step through a backend.

A backend prepares once per step (`begin_step`) and returns the per-layer function; the layers call
it with no checks or re-derivation. "torch" runs SDPA over the first L + T keys with the step's dense
mask, written into a preallocated buffer (on CPU the fastest choice for a few hundred query rows; it
reads L on the host, so it cannot be replayed by a CUDA graph). "triton" runs the kernel's prepared
plan, which reads L from a device tensor, so a captured graph replays it at any L.

A batch of b sequences steps together with one L per row (`lengths` [b] on the device, `prefix_lens`
the same on the host): "torch" builds a [b, 1, T, max(L) + T] mask from them each step, "triton" hands
the kernel the [b] lengths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lookahead.kernels import StepAttentionPlan, StepPattern, masked_attention

from .kv_cache import KVCache, row_index

# layer, q [B, Hq, T, D], k and v [B, Hkv, T, D] (this layer's new entries) -> [B, Hq, T, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# layer, q, that layer's whole cache buffers k_all and v_all [B, Hkv, capacity, D] -> [B, Hq, T, D]
LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over the forward pass's own tokens (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


def cached(cache: KVCache, slots: torch.Tensor, attend: LayerAttention, rows: slice = slice(None)) -> Attend:
    """Write each layer's new K/V into cache rows `rows` at positions `slots` ([T], or [b, T] per row), then
    attend over those rows of the layer's cache."""

    batch = row_index(slots) if slots.ndim == 2 else None  # once per forward, not once per layer

    def layer_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all, v_all = cache.write(layer, slots, k, v, rows, batch)
        return attend(layer, q, k_all, v_all)

    return layer_attention


def prefill_attention(prefix_len: int, fold_gqa: bool | None = None) -> LayerAttention:
    """Causal attention of a prefill written after `prefix_len` cached positions. Past a prefix the mask is built
    once, by the first layer; fold_gqa (default: on CUDA) as in `TorchBackend`."""
    built: list[torch.Tensor] = []

    def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        if prefix_len == 0:
            return causal(layer, q, k_all[:, :, :t], v_all[:, :, :t])
        fold = q.is_cuda if fold_gqa is None else fold_gqa
        if not built:
            mask = torch.ones(t, prefix_len + t, dtype=torch.bool, device=q.device).tril(prefix_len)
            built.append(additive_mask(mask, q.shape[1] // k_all.shape[1], q.dtype) if fold else mask)
        if fold:
            return folded_attention(q, k_all, v_all, prefix_len, built[0])
        return masked_attention(q, k_all, v_all, prefix_len, built[0])

    return attend


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, Hq, T, D] over the first prefix_len + T keys of k, v [B, Hkv, S, D] with the GQA group folded
    into the query rows ([B, Hkv, group x T, D], row g x T + t is head h_kv x group + g, token t) and an additive
    float mask `bias` ([group x T, L + T] or [B, 1, group x T, L + T], 0 or -inf; None: all visible).

    On CUDA, SDPA with a bool mask and `enable_gqa` can only use its math kernel; with no GQA and a float mask the
    memory-efficient kernel runs. The same softmax, so the same result up to rounding order."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    end = prefix_len + t
    folded = q.reshape(b, hkv, (hq // hkv) * t, d)
    out = F.scaled_dot_product_attention(folded, k[:, :, :end], v[:, :, :end], attn_mask=bias)
    return out.view(b, hq, t, d)


def additive_mask(mask: torch.Tensor | None, group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask [..., T, S] (True = attend) as `folded_attention`'s bias [..., group x T, S] in `dtype`."""
    if mask is None:
        return None
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(*(1,) * (mask.ndim - 2), group, 1)


class TorchBackend:
    """SDPA with the step's dense mask in a preallocated [max_tokens, capacity] buffer.

    The buffer's columns stay True except a step's own T x T block, which is written before the
    forward and reset after it (`end_step`), so no per-step allocation grows with the sequence. A batch
    step (rows with different L) builds its [b, 1, T, max(L) + T] mask instead: each row sees its own
    prefix, its own step block at L_b, and nothing past it (another row's longer prefix is not its own).
    A chains block is built once per pattern; a tree block every step, from the step's tree_end.

    fold_gqa (default: on CUDA): hand SDPA the GQA group folded into the query rows and the mask as an additive
    float bias, built once per step (`folded_attention`), so CUDA's memory-efficient kernel can run instead of the
    math kernel; on a CPU the bool mask with `enable_gqa` measured fine and stays.
    """

    name, graphable = "torch", False

    def __init__(self, capacity: int, max_tokens: int, device: torch.device, fold_gqa: bool | None = None) -> None:
        self.fold_gqa = torch.device(device).type == "cuda" if fold_gqa is None else fold_gqa
        self._mask = torch.ones(max_tokens, capacity, dtype=torch.bool, device=device)
        self._columns = torch.arange(capacity, device=device)
        self._step_masks: dict[StepPattern, torch.Tensor] = {}
        self._block: torch.Tensor | None = None

    def begin_step(self, pattern: StepPattern, prefix_lens: list[int], lengths: torch.Tensor,
                   tree_end: torch.Tensor | None = None) -> LayerAttention:
        """tree_end: tree form, this step's [b, V] on the device (the pattern stands for the shape only)."""
        blocks = self._step_blocks(pattern, len(prefix_lens), tree_end)  # [b, T, T]
        if len(prefix_lens) > 1:
            return self._batch_step(pattern, prefix_lens, lengths, blocks)
        t = pattern.num_tokens
        prefix_len = prefix_lens[0]
        mask = None
        if t > 1:
            self._block = self._mask[:t, prefix_len : prefix_len + t]
            self._block.copy_(blocks[0])
            mask = self._mask[:t, : prefix_len + t]
        return self._attend(prefix_len, mask)

    def _attend(self, prefix_len: int, mask: torch.Tensor | None) -> LayerAttention:
        if not self.fold_gqa:
            def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
                return masked_attention(q, k_all, v_all, prefix_len, mask)

            return attend
        bias: list[torch.Tensor | None] = []  # built by the first layer, which knows the group and the dtype

        def attend_folded(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            if not bias:
                bias.append(additive_mask(mask, q.shape[1] // k_all.shape[1], q.dtype))
            return folded_attention(q, k_all, v_all, prefix_len, bias[0])

        return attend_folded

    def _step_blocks(self, pattern: StepPattern, batch: int, tree_end: torch.Tensor | None) -> torch.Tensor:
        """Each row's T x T visibility block: [b, T, T]."""
        if pattern.is_tree:
            idx = torch.arange(pattern.num_tokens, device=self._mask.device)
            return torch.stack([pattern.visible(idx[:, None], idx[None, :], row) for row in tree_end])
        if pattern not in self._step_masks:
            self._step_masks[pattern] = pattern.materialize(0, device=self._mask.device)
        return self._step_masks[pattern].expand(batch, -1, -1)

    def _batch_step(self, pattern: StepPattern, prefix_lens: list[int], lengths: torch.Tensor,
                    blocks: torch.Tensor) -> LayerAttention:
        t = pattern.num_tokens
        width = max(prefix_lens) + t
        offset = self._columns[:width] - lengths[:, None]  # [b, width]: key j of the step sits at L_b + j
        in_step = (offset >= 0) & (offset < t)
        rows = torch.arange(len(prefix_lens), device=offset.device)[:, None, None]
        block = blocks[rows, torch.arange(t, device=offset.device)[None, :, None], offset.clamp(0, t - 1)[:, None]]
        mask = ((offset < 0)[:, None] | (in_step[:, None] & block))[:, None]  # [b, 1, T, width]
        return self._attend(width - t, mask)

    def end_step(self) -> None:
        if self._block is not None:
            self._block.fill_(True)  # these columns are prefix for the next step
            self._block = None


class TritonBackend:
    """The Triton kernel through one prepared plan per (step shape, batch size), checked once, launched per
    layer with the rows' device lengths; a tree comes with each call, as data."""

    name, graphable = "triton", True

    def __init__(self, heads_q: int, heads_kv: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self._shape = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
                           device=device, max_len=capacity)
        self._plans: dict[tuple, StepAttentionPlan] = {}

    def begin_step(self, pattern: StepPattern, prefix_lens: list[int], lengths: torch.Tensor,
                   tree_end: torch.Tensor | None = None) -> LayerAttention:
        """tree_end: tree form, this step's [b, V] on the device (the pattern stands for the shape only)."""
        key = (pattern.shape, len(prefix_lens))
        if key not in self._plans:
            self._plans[key] = StepAttentionPlan(pattern, batch=len(prefix_lens), **self._shape)
        plan = self._plans[key]

        def attend(layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
            return plan(q, k_all, v_all, lengths, tree_end)

        return attend

    def end_step(self) -> None:
        pass
