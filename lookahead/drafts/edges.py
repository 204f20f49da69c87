"""How likely an offered draft edge (a token under a parent) is the model's argmax there: `EDGE_PROBABILITY`.

An edge's evidence is one state per source: where the token sits in the recycled top-k of its parent (keyed by
the parent's previous tokens and token, else by the parent token alone), whether a suffix match proposes it
(first token or later, and how long the match behind it is: 1, 2-3, 4-7, 8-15 or 16+ tokens) and whether a pool
n-gram does (first token or later), each either
from the current generation or from the drafting memory of earlier ones (`memory.py`). The
probability is a logistic model additive in those states, given that the parent is accepted, with weights fitted
on the edges of the dev prompts' steps (bench/data, the default model, both budgets). The weights are fixed:
moving them by a gradient step after every verified step changed S by noise only (bench/results/tri18-cpu.json
against split18-old-cpu.json) and cost host time every step.
"""

from __future__ import annotations

import math
from bisect import bisect_right

# recycle: rank 0, 1, 2, 3+ in the context (triple, else pair) table | absent from it | rank 0, 1, 2, 3+ in the
# token table (no context entry) | absent from it | no entry at all
_RECYCLE_OWN = (2.05, 0.0, -0.57, -0.88, -1.3, 1.23, -0.26, -0.21, -0.91, -0.79, 0.26)
MATCH_BANDS = (1, 2, 4, 8, 16)
"""The suffix match lengths that start a band of their own: a long exact match is the strongest evidence there is
(text copied from the prompt or the output), so its chain can take the whole budget where short matches share it."""
# suffix: none | first token, match band 1, 2-3, 4-7, 8-15, 16+ | later token, the same bands. Refitted with the
# match bands, own and memory states together, the rest held, on 12 dev prompts (3 of each kind, 256 tokens, warm in
# a stream; bench/results/fit-edges-suffix-cpu.json). A later token was right 51% of the time behind a match of 1,
# 67% of 2-3, 77% of 4-7, 84% of 8-15 and 95% of 16+
_SUFFIX_OWN = (-1.99, -1.19, -0.17, 0.22, 1.69, 1.74, -0.48, 0.53, 0.81, 1.78, 2.79)
# pool: none | first token | later token
_POOL_OWN = (-0.64, -0.42, -0.3)
# Evidence from the drafting memory (earlier generations' tables, texts and n-grams), in states of its own, the same
# as the generation's but "none" (recycle: the first 10, suffix and pool: all but none). Fitted with the own weights
# held, on every offered edge of warm generations of 20 dev prompts in a stream (bench/fit_edges.py,
# bench/results/fit-edges-cpu.json): each state that proposes a token weaker than its own twin, the pool's first
# tokens most (right 1% of the time)
MEMORY_RECYCLE_WEIGHTS = (0.77, -0.43, -1.0, -1.64, -1.06, 0.26, -0.91, -1.16, -1.76, -0.24)
MEMORY_SUFFIX_WEIGHTS = (-2.05, -1.1, 0.16, -0.42, -0.42, -1.17, -0.8, 0.26, 0.49, 0.37)
MEMORY_POOL_WEIGHTS = (-2.13, -0.18)
RECYCLE_WEIGHTS = _RECYCLE_OWN + MEMORY_RECYCLE_WEIGHTS
SUFFIX_WEIGHTS = _SUFFIX_OWN + MEMORY_SUFFIX_WEIGHTS
POOL_WEIGHTS = _POOL_OWN + MEMORY_POOL_WEIGHTS

# An edge's state is one int, recycle * _R + suffix * _S + pool: the builder adds a source's part to it
_S = len(POOL_WEIGHTS)
_R = len(SUFFIX_WEIGHTS) * _S
NO_RECYCLE = 10 * _R  # no recycled list under the parent at all

EDGE_PROBABILITY = [1.0 / (1.0 + math.exp(-(a + b + c)))
                    for a in RECYCLE_WEIGHTS for b in SUFFIX_WEIGHTS for c in POOL_WEIGHTS]
"""P(edge right | parent accepted) = sigmoid(recycle weight + suffix weight + pool weight), for every state: scoring
an edge is one list index."""


def recycle_state(context: bool, rank: int | None, memory: bool = False) -> int:
    """A token in its parent's recycled list (from a context table, else the token table; the generation's own or
    the memory's); rank None: not in it."""
    return ((0 if context else 5) + (4 if rank is None else min(rank, 3)) + (11 if memory else 0)) * _R


def suffix_state(match: int, later: bool, memory: bool = False) -> int:
    """A token of a suffix continuation (its first or a later one) behind a match of `match` tokens."""
    band = bisect_right(MATCH_BANDS, match) - 1
    return (1 + band + (len(MATCH_BANDS) if later else 0) + (2 * len(MATCH_BANDS) if memory else 0)) * _S


def pool_state(later: bool, memory: bool = False) -> int:
    return (2 if later else 1) + (2 if memory else 0)


def stronger(slot: int, state: int, than: int) -> bool:
    """Whether the suffix (slot 1) or pool (slot 2) part `state` is stronger evidence than `than`."""
    if slot == 1:
        return SUFFIX_WEIGHTS[state // _S] > SUFFIX_WEIGHTS[than // _S]
    return POOL_WEIGHTS[state] > POOL_WEIGHTS[than]
