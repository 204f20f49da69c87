"""Turning logits into the target distribution (temperature, top-k, top-p) and drawing from it.

Plain sampling and lookahead's sample verification both use `target_probs`, so the distribution that
lookahead preserves is exactly the one plain sampling draws from.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means off; top_p in (0, 1]."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] fp32 probabilities after temperature, top-k, then top-p."""
    # shift the max to 0 and divide in float64: any temperature > 0, however small (1e-40), stays finite
    # (the max at 0, the rest at most -inf), where fp32 logits / 1e-40 overflow to inf and softmax gives NaN
    logits = logits.double()
    logits = ((logits - logits.max(-1, keepdim=True).values) / params.temperature).float()
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest head whose mass reaches top_p: drop a token once the mass before it does
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """The random source of one generation: uniforms in Python, categorical draws on the logits' device."""

    def __init__(self, seed: int | None, device: torch.device) -> None:
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        self.uniform = random.Random(seed).random
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a [V] probability vector (need not be normalised)."""
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
