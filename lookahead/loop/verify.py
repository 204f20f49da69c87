"""Verification of a step's draft tree: greedy (the paper's Algorithm 3) and sampling (Algorithm 4), walked down the
tree from the input token. Both speak verified slots (`StepLayout`'s numbering: 0 the input token, 1 + j node j),
whose outputs predict the token after them.

Greedy takes the longest path whose every token is the model's argmax at its parent, then the argmax after it
(1..depth + 1 tokens a step). Sampling applies Algorithm 4 at each node over its children: accept a child with its
residual target probability, else remove its token and renormalise before the next; when all are rejected, draw
from that residual and stop. The drafts never depend on the step's random draws, so the output keeps the target
distribution (Appendix B of the paper; chains are the trie of their candidates, see `lookahead.drafts.chains`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lookahead.drafts import ROOT, DraftTree


@dataclass(frozen=True)
class Verdict:
    """Accepted tokens (the path's tokens, then one of the model's own) and the last node taken (ROOT: none)."""

    tokens: list[int]
    node: int

    @property
    def run(self) -> int:
        """Draft tokens accepted (the last token is always the model's own)."""
        return len(self.tokens) - 1


def greedy_verify(tree: DraftTree, argmax: Sequence[int]) -> Verdict:
    """argmax: the model's argmax at each verified slot (slot 0 the input token, 1 + j node j)."""
    node, tokens = ROOT, []
    while True:
        want = argmax[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return Verdict(tokens + [want], node)
        tokens.append(want)
        node = child


def sample_verify(tree: DraftTree, prob_of: Callable[[int, int], float], uniform: Callable[[], float],
                  draw: Callable[[int], int]) -> Verdict:
    """prob_of(slot, token) -> the target probability of token after that slot; draw(slot) -> a token from the
    target there without its children's tokens (a leaf: the target itself); uniform() -> U(0, 1)."""
    node, tokens = ROOT, []
    while True:
        children = list(tree.children(node))
        chosen = _accept_one([tree.tokens[child] for child in children], node + 1, prob_of, uniform)
        if chosen is None:
            return Verdict(tokens + [draw(node + 1)], node)
        node = children[chosen]
        tokens.append(tree.tokens[node])


def _accept_one(tokens: Sequence[int], slot: int, prob_of: Callable[[int, int], float],
                uniform: Callable[[], float]) -> int | None:
    """Algorithm 4 at one slot: try `tokens` in turn, accepting one with its residual target probability; a rejected
    token leaves the distribution and the rest is renormalised. Returns the index of the accepted one, None when all
    were rejected (then the residual is the target without every one of `tokens`)."""
    rejected_mass = 0.0
    for i, token in enumerate(tokens):  # siblings hold distinct tokens
        p = prob_of(slot, token)
        if uniform() * (1.0 - rejected_mass) < p:
            return i
        rejected_mass += p
    return None
