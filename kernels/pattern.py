"""The lookahead step layout and its attention pattern: the one source of truth.

A step feeds T = (W + g) * (N - 1) tokens (see DESIGN.md, "One decoding step"):

    step index            part                       relative position
    W*l + i               level l, column i          l + i       (l = 0..N-2, i = 0..W-1)
    W*(N-1) + c*(N-1)+k-1 candidate c, token k       k           (c = 0..g-1, k = 1..N-1)

Level 0 column 0 is the input token. `visible(q, k)` below is the rule; the Triton kernel
(`triton_attention.py`, `_visible`) writes the same comparisons line for line, and a test pins
the two together. `materialize()` builds a dense mask for the reference and tests only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class StepPattern:
    """One step's layout for window W, n-gram size N and g candidates present in the step."""

    window: int
    ngram: int
    candidates: int

    def __post_init__(self) -> None:
        for name, value, low in (("window", self.window, 1), ("ngram", self.ngram, 2), ("candidates", self.candidates, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")

    @property
    def lookahead_len(self) -> int:
        """Tokens of the lookahead branch: W columns x (N - 1) levels."""
        return self.window * (self.ngram - 1)

    @property
    def num_tokens(self) -> int:
        """T = (W + g) * (N - 1)."""
        return (self.window + self.candidates) * (self.ngram - 1)

    @property
    def max_commit(self) -> int:
        """The most KV entries a verdict of this step commits: the input token plus a whole candidate."""
        return self.ngram if self.candidates > 0 else 1

    def level_index(self, level: int, column: int) -> int:
        """Step index of level `level`, column `column` of the lookahead branch."""
        return self.window * level + column

    def candidate_index(self, candidate: int, token: int) -> int:
        """Step index of token `token` (1..N-1) of candidate `candidate`."""
        return self.lookahead_len + candidate * (self.ngram - 1) + token - 1

    def last_level_indices(self) -> range:
        """Step indices of the last level, whose outputs close the lookahead n-grams."""
        start = self.level_index(self.ngram - 2, 0)
        return range(start, start + self.window)

    @cached_property
    def relative_positions(self) -> torch.Tensor:
        """[T] int64: the position of each step token relative to the input token."""
        idx = torch.arange(self.num_tokens)
        la = idx < self.lookahead_len
        level, column = idx // self.window, idx % self.window
        cand_token = (idx - self.lookahead_len) % (self.ngram - 1) + 1
        return torch.where(la, level + column, cand_token)

    def visible(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """Whether step token `q_idx` attends to step token `k_idx` (broadcasting int tensors)."""
        W, N = self.window, self.ngram
        la_len = W * (N - 1)
        q_la, k_la = q_idx < la_len, k_idx < la_len
        q_level, q_col = q_idx // W, q_idx % W
        k_level, k_col = k_idx // W, k_idx % W
        # lookahead: level 0 columns up to the query's, and the query's own column up to its level
        lookahead = q_la & k_la & (((k_level == 0) & (k_col <= q_col)) | ((k_col == q_col) & (k_level <= q_level)))
        q_cand, k_cand = (q_idx - la_len) // (N - 1), (k_idx - la_len) // (N - 1)
        # candidates: the input token, and their own earlier tokens
        candidate = ~q_la & ((k_idx == 0) | (~k_la & (k_cand == q_cand) & (k_idx <= q_idx)))
        return lookahead | candidate

    def materialize(self, prefix_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense bool mask [T, prefix_len + T] (True = attend). For the reference and tests only."""
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        t = self.num_tokens
        idx = torch.arange(t, device=device)
        step = self.visible(idx[:, None], idx[None, :])
        prefix = torch.ones(t, prefix_len, dtype=torch.bool, device=device)
        return torch.cat([prefix, step], dim=1)


def lookahead_mask(window: int, ngram: int, guesses: int, prefix_len: int) -> torch.Tensor:
    """Bool [T, prefix_len + T] mask of one step (True = attend); the reference the kernel is held to."""
    return StepPattern(window, ngram, guesses).materialize(prefix_len)
