"""How likely an offered draft edge (a token under a parent) is the model's argmax there: `EDGE_PROBABILITY`.

An edge's evidence is one state per source: where the token sits in the recycled top-k of its parent (keyed by
the parent's previous tokens and token, else by the parent token alone), whether a suffix match proposes it
(first token or later, match length 1 or more) and whether a pool n-gram does (first token or later). The
probability is a logistic model additive in those states, given that the parent is accepted, with weights fitted
on the edges of the dev prompts' steps (bench/data, the default model, both budgets). The weights are fixed:
moving them by a gradient step after every verified step changed S by noise only (bench/results/tri18-cpu.json
against split18-old-cpu.json) and cost host time every step.
"""

from __future__ import annotations

import math

# recycle: rank 0, 1, 2, 3+ in the context (triple, else pair) table | absent from it | rank 0, 1, 2, 3+ in the
# token table (no context entry) | absent from it | no entry at all
RECYCLE_WEIGHTS = (2.05, 0.0, -0.57, -0.88, -1.3, 1.23, -0.26, -0.21, -0.91, -0.79, 0.26)
# suffix: none | first token, match 1 | first token, match 2+ | later token, match 1 | later token, match 2+
SUFFIX_WEIGHTS = (-1.55, -1.03, -0.08, -0.12, 1.39)
# pool: none | first token | later token
POOL_WEIGHTS = (-0.64, -0.42, -0.3)

# An edge's state is one int, recycle * _R + suffix * _S + pool: the builder adds a source's part to it
_S = len(POOL_WEIGHTS)
_R = len(SUFFIX_WEIGHTS) * _S
NO_RECYCLE = 10 * _R  # no recycled list under the parent at all

EDGE_PROBABILITY = [1.0 / (1.0 + math.exp(-(a + b + c)))
                    for a in RECYCLE_WEIGHTS for b in SUFFIX_WEIGHTS for c in POOL_WEIGHTS]
"""P(edge right | parent accepted) = sigmoid(recycle weight + suffix weight + pool weight), for every state: scoring
an edge is one list index."""


def recycle_state(context: bool, rank: int | None) -> int:
    """A token in its parent's recycled list (from a context table, else the token table); rank None: not in it."""
    return ((0 if context else 5) + (4 if rank is None else min(rank, 3))) * _R


def suffix_state(match: int, later: bool) -> int:
    return ((3 if later else 1) + (match >= 2)) * _S


def pool_state(later: bool) -> int:
    return 2 if later else 1


def stronger(slot: int, state: int, than: int) -> bool:
    """Whether the suffix (slot 1) or pool (slot 2) part `state` is stronger evidence than `than`."""
    if slot == 1:
        return SUFFIX_WEIGHTS[state // _S] > SUFFIX_WEIGHTS[than // _S]
    return POOL_WEIGHTS[state] > POOL_WEIGHTS[than]
