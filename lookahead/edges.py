"""`EdgeModel`: how likely an offered draft edge (a token under a parent) is the model's argmax there.

An edge's evidence is one state per source: where the token sits in the recycled top-k of its parent (keyed by
the parent's previous token and token, else by the parent token alone), whether a suffix match proposes it
(first token or later, match length 1 or more) and whether a pool n-gram does (first token with or without a
context match, or later). The probability is a logistic model additive in those states, given that the parent
is accepted. Its starting weights were fitted on the edges of the dev prompts' steps (bench/data, the default
model, both budgets); every verified step then moves them by online gradient steps, so the scores follow the
text being generated (a copy-heavy code prompt trusts suffix matches more than a chat).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# recycle: rank 0, 1, 2, 3+ in the (previous, token) table | absent from it | rank 0, 1, 2, 3+ in the token table
# (no pair entry) | absent from it | no entry at all
PRIOR_RECYCLE = (2.05, 0.0, -0.57, -0.88, -1.3, 1.23, -0.26, -0.21, -0.91, -0.79, 0.26)
# suffix: none | first token, match 1 | first token, match 2+ | later token, match 1 | later token, match 2+
PRIOR_SUFFIX = (-1.55, -1.03, -0.08, -0.12, 1.39)
# pool: none | first token, no context match | first token, context match | later token
PRIOR_POOL = (-0.64, -0.42, -0.03, -0.3)
LEARNING_RATE = 0.02


def recycle_state(pair: bool, rank: int | None, seen: bool = True) -> int:
    """State of a token in its parent's recycled list: from the pair table or the token table; rank None: not in
    the list; seen False: no list at all."""
    if not seen:
        return 10
    base = 0 if pair else 5
    return base + 4 if rank is None else base + min(rank, 3)


def suffix_state(match: int, later: bool) -> int:
    return (3 if later else 1) + (match >= 2)


def pool_state(match: int, later: bool) -> int:
    return 3 if later else (2 if match else 1)


class EdgeModel:
    """P(edge right | parent accepted) = sigmoid(w_recycle[a] + w_suffix[b] + w_pool[c]), learned online."""

    _PRIORS = (PRIOR_RECYCLE, PRIOR_SUFFIX, PRIOR_POOL)

    def __init__(self, learning_rate: float = LEARNING_RATE) -> None:
        self.weights = [list(p) for p in self._PRIORS]
        self.learning_rate = learning_rate
        self._memo: dict[tuple[int, int, int], float] = {}

    @classmethod
    def stronger(cls, slot: int, state: int, than: int) -> bool:
        """Whether `state` of source `slot` (1 suffix, 2 pool) is stronger evidence than `than` (by the priors)."""
        prior = cls._PRIORS[slot]
        return prior[state] > prior[than]

    def prob(self, a: int, b: int, c: int) -> float:
        key = (a, b, c)
        p = self._memo.get(key)
        if p is None:
            w = self.weights
            p = self._memo[key] = 1.0 / (1.0 + math.exp(-(w[0][a] + w[1][b] + w[2][c])))
        return p

    def learn(self, states: Sequence[tuple[int, int, int]], rights: Sequence[bool]) -> None:
        """One gradient step of the log-loss per observed edge."""
        if not self.learning_rate or not states:
            return
        w, rate = self.weights, self.learning_rate
        for (a, b, c), right in zip(states, rights, strict=True):
            g = rate * (right - 1.0 / (1.0 + math.exp(-(w[0][a] + w[1][b] + w[2][c]))))
            w[0][a] += g
            w[1][b] += g
            w[2][c] += g
        self._memo.clear()
