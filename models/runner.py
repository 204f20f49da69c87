"""`CachedRunner`: a `Llama` with its KV cache, speaking the decode loop's `StepModel` protocol."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lookahead.kernels import StepPattern

from .attention import AttentionContext
from .kv_cache import KVCache
from .llama import Llama


class CachedRunner:
    """Prefill, lookahead steps and commits over a preallocated cache of `capacity` positions.

    `length` is L, the positions holding committed entries. The torch backend's step mask lives in a
    preallocated [max_step_tokens, capacity] buffer whose prefix columns stay True, so a step writes only
    its own T x T block and no per-step allocation grows with the sequence.
    """

    def __init__(self, model: Llama, capacity: int, max_step_tokens: int = 1) -> None:
        cfg = model.config
        self.model = model
        self.cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, capacity, cfg.head_dim,
                             model.dtype, model.device)
        self.length = 0
        self._mask = None
        if model.attn_backend == "torch" and max_step_tokens > 1:
            self._mask = torch.ones(max_step_tokens, capacity, dtype=torch.bool, device=model.device)
        self._step_masks: dict[StepPattern, torch.Tensor] = {}
        self._positions: dict[StepPattern, torch.Tensor] = {}

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], device=self.model.device)
        positions = torch.arange(self.length, self.length + len(tokens), device=ids.device)
        ctx = AttentionContext(self.model.attn_backend, self.cache, self.length)
        rows = torch.tensor([len(tokens) - 1], device=ids.device)
        logits = self.model(ids, positions, ctx, rows)
        self.length += len(tokens)
        return logits[0, 0]

    def step(self, tokens: Sequence[int], pattern: StepPattern, rows: Sequence[int]) -> torch.Tensor:
        device = self.model.device
        if self.length + pattern.num_tokens > self.cache.capacity:
            raise ValueError(f"step of {pattern.num_tokens} tokens at L={self.length} overflows the KV cache "
                             f"({self.cache.capacity} positions)")
        ids = torch.tensor([list(tokens)], device=device)
        positions = self._relative_positions(pattern) + self.length
        ctx = AttentionContext(self.model.attn_backend, self.cache, self.length, pattern)
        end = self.length + pattern.num_tokens
        if self._mask is not None and pattern.num_tokens > 1:
            block = self._mask[: pattern.num_tokens, self.length : end]
            block.copy_(self._step_mask(pattern))
            ctx.mask = self._mask[: pattern.num_tokens, :end]
        try:
            logits = self.model(ids, positions, ctx, torch.tensor(list(rows), device=device))
        finally:
            if ctx.mask is not None:
                block.fill_(True)  # these columns are prefix for the next step
        return logits[0]

    def commit(self, step_indices: Sequence[int]) -> None:
        self.cache.commit(self.length, step_indices)
        self.length += len(step_indices)

    def _relative_positions(self, pattern: StepPattern) -> torch.Tensor:
        if pattern not in self._positions:
            self._positions[pattern] = pattern.relative_positions.to(self.model.device)
        return self._positions[pattern]

    def _step_mask(self, pattern: StepPattern) -> torch.Tensor:
        if pattern not in self._step_masks:
            self._step_masks[pattern] = pattern.materialize(0, device=self.model.device)
        return self._step_masks[pattern]
