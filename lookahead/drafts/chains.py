"""`ChainDrafts`: the paper's verification branch as a draft policy: the pool's G candidate n-grams for the input
token, built into a trie (one path per candidate, a shared prefix stored once, siblings in the order of the
candidates that first hold them).

Walking that trie accepts exactly what the paper's Algorithm 3 accepts over the separate candidates: the longest
candidate prefix the model agrees with (the path it spells) and the model's token after it. (Sampling walks it the
same way, with each position's seeded draw for the argmax: `lookahead.loop.verify`.) Merged prefixes make a step
shorter than the paper's (W + g)(N - 1) tokens, never different in outcome.
"""

from __future__ import annotations

from collections.abc import Sequence

from .pool import NGramPool
from .tree import ROOT, DraftTree


class ChainDrafts:
    """The chains form's draft policy: no sources of its own besides the pool, no top-k needed."""

    topk = 0  # next tokens per row the step must return (recycling only)

    def __init__(self, ngram: int, guesses: int) -> None:
        self.ngram, self.guesses = ngram, guesses

    def build(self, sequence: Sequence[int], pool: NGramPool, budget: int, levels: int) -> DraftTree:
        """The trie of the pool's candidates for the input token `sequence[-1]`; during warm-up, while the window
        has `levels` < N - 1 levels, of their first `levels` tokens (the pattern of a smaller N)."""
        candidates = pool.candidates(sequence[-1], self.guesses)
        if levels < self.ngram - 1:
            candidates = [candidate[:levels] for candidate in candidates]
        return chain_trie(candidates)

    def extend(self, tokens: Sequence[int]) -> None:
        """Accepted tokens: nothing to learn (the pool is fed by the loop)."""


def chain_trie(candidates: Sequence[Sequence[int]]) -> DraftTree:
    """Candidate token sequences as a trie under the input token, in pre-order."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for candidate in candidates:
        parent = ROOT
        for token in candidate:
            node = node_of.get((parent, token))
            if node is None:
                node = node_of[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return DraftTree.grown(tokens, parents)
