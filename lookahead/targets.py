"""The target probabilities a sampling verification reads (Algorithm 4), and where they come from.

The walk reads single entries p(token | row) for the drafts it tries (`reads` lists every pair it may ask
for, so they can be fetched at once), and one whole distribution, at the row where it stops, to draw from.
`LocalTargets` takes them from the step's logits on this process; lookahead parallelism gathers them from
the ranks that own the rows (`lookahead.parallel`). Both read the same pairs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .layout import StepLayout
from .sampling import SamplingParams, target_probs


class Targets(Protocol):
    """probs(step index) -> [V] the target distribution there; prob_of(step index, token) -> one entry of it."""

    def probs(self, index: int) -> torch.Tensor: ...

    def prob_of(self, index: int, token: int) -> float: ...


def verified_rows(layout: StepLayout) -> list[int]:
    """The step indices whose outputs are distributions the walk may read: the input token and every draft token
    (the lookahead rows are only argmaxed)."""
    return [0, *layout.candidate_rows]


def reads(layout: StepLayout) -> list[tuple[int, int]]:
    """Every (step index, token) whose probability the walk may read. Chains: each source row (the input token and
    every candidate token but the last) at every candidate token (the walk tries, at a source, the next tokens of
    the candidates that share the accepted prefix). Tree: each node's token at its parent's row."""
    if layout.tree is not None:
        return [(layout.node_index(parent), token) for parent, token in zip(layout.tree.parents, layout.tree.tokens,
                                                                            strict=True)]
    candidates, pattern = layout.candidates, layout.pattern
    sources = [0] + [pattern.candidate_index(c, k) for c, g in enumerate(candidates) for k in range(1, len(g))]
    vocab = sorted({t for candidate in candidates for t in candidate})
    return [(s, t) for s in sources for t in vocab]


class LocalTargets:
    """The targets from the step's logits [R, V] (rows as `layout.rows`), the read entries fetched at once."""

    def __init__(self, layout: StepLayout, logits: torch.Tensor, sampling: SamplingParams) -> None:
        verified = verified_rows(layout)
        self._probs = target_probs(logits[[layout.row_of[i] for i in verified]], sampling)
        self._row = {index: r for r, index in enumerate(verified)}
        pairs = reads(layout)
        # the few probabilities the walk reads, fetched at once (one device sync)
        values = self._probs[[self._row[s] for s, _ in pairs], [t for _, t in pairs]].tolist() if pairs else []
        self._lookup = dict(zip(pairs, values, strict=True))

    def probs(self, index: int) -> torch.Tensor:
        return self._probs[self._row[index]]

    def prob_of(self, index: int, token: int) -> float:
        return self._lookup[(index, token)]
