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
LEARNING_RATE = 0.05


# An edge's state is one int, recycle * _R + suffix * _S + pool: the builder adds a source's part to it
_S = len(PRIOR_POOL)
_R = len(PRIOR_SUFFIX) * _S
NO_RECYCLE = 10 * _R  # no recycled list under the parent at all


def recycle_state(pair: bool, rank: int | None) -> int:
    """A token in its parent's recycled list (from the pair table, else the token table); rank None: not in it."""
    return ((0 if pair else 5) + (4 if rank is None else min(rank, 3))) * _R


def suffix_state(match: int, later: bool) -> int:
    return ((3 if later else 1) + (match >= 2)) * _S


def pool_state(match: int, later: bool) -> int:
    return 3 if later else (2 if match else 1)


def suffix_part(state: int) -> int:
    return state % _R - state % _S


def pool_part(state: int) -> int:
    return state % _S


class EdgeModel:
    """P(edge right | parent accepted) = sigmoid(w_recycle[a] + w_suffix[b] + w_pool[c]), learned online; `table`
    holds it for every state, so scoring an edge is one list index."""

    def __init__(self, learning_rate: float | None = None) -> None:
        self.weights = [list(PRIOR_RECYCLE), list(PRIOR_SUFFIX), list(PRIOR_POOL)]
        self.learning_rate = LEARNING_RATE if learning_rate is None else learning_rate
        self.table: list[float] = []
        self._tabulate()

    @staticmethod
    def stronger(slot: int, state: int, than: int) -> bool:
        """Whether the suffix (slot 1) or pool (slot 2) part `state` is stronger evidence than `than` (by the
        priors)."""
        if slot == 1:
            return PRIOR_SUFFIX[state // _S] > PRIOR_SUFFIX[than // _S]
        return PRIOR_POOL[state] > PRIOR_POOL[than]

    def _tabulate(self) -> None:
        wa, wb, wc = self.weights
        self.table = [1.0 / (1.0 + math.exp(-(a + b + c))) for a in wa for b in wb for c in wc]

    def learn(self, states: Sequence[int], rights: Sequence[bool]) -> None:
        """One gradient step of the log-loss per observed edge."""
        if not self.learning_rate or not states:
            return
        wa, wb, wc = self.weights
        rate = self.learning_rate
        for state, right in zip(states, rights, strict=True):
            a, rest = divmod(state, _R)
            b, c = divmod(rest, _S)
            g = rate * (right - 1.0 / (1.0 + math.exp(-(wa[a] + wb[b] + wc[c]))))
            wa[a] += g
            wb[b] += g
            wc[c] += g
        self._tabulate()
