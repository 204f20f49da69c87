"""Verification of a step's draft tree (the paper's Algorithm 3, and with seeded races Algorithm 4's outcome), walked
down the tree from the input token. It speaks verified slots (`StepLayout`'s numbering: 0 the input token, 1 + j
node j), each with the token the model chooses after it: the argmax when greedy, the seeded race's winner at that
position when sampling (`lookahead.loop.sampling`).

The walk takes the longest path whose every token is the token chosen at its parent, then the token chosen after
it (1..depth + 1 tokens a step). With sampling the chosen token at each position is what plain seeded sampling
draws there, so the output is plain sampling's, token for token, and a child is accepted with its target
probability (Algorithm 4's rate for a single draft token).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def verify(tree: DraftTree, chosen: Sequence[int]) -> Verdict:
    """chosen: the model's token after each verified slot (slot 0 the input token, 1 + j node j)."""
    node, tokens = ROOT, []
    drafted, ends = tree.tokens, tree.tree_end
    while True:
        want = chosen[node + 1]
        # the first child holding `want`: `tree.children(node)` inline, hopping over each child's subtree
        child, end = (0, len(drafted)) if node == ROOT else (node + 1, ends[node])
        while child < end and drafted[child] != want:
            child = ends[child]
        if child >= end:
            return Verdict(tokens + [want], node)
        tokens.append(want)
        node = child
