"""Verification of the step's drafts: greedy (paper Algorithm 3) and sampling (Algorithm 4), over chains and trees.

Chains: walk the candidates position by position, keeping the candidates that share the accepted prefix;
return a run of one candidate's tokens followed by one token of the model's own (1..N tokens a step),
plus which candidate the run came from. Tree: walk down from the input token, each time to the child that
is accepted, and return the path's tokens plus one token of the model's own, plus the last node taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lookahead.kernels import StepPattern

from .tree import ROOT, DraftTree


@dataclass(frozen=True)
class Verdict:
    """Accepted tokens (candidate run + the model's next token) and the candidate the run came from."""

    tokens: list[int]
    candidate: int  # chains: the candidate the run came from; tree: the last node taken; -1 when none

    @property
    def run(self) -> int:
        """Candidate tokens accepted (the last token is always the model's own)."""
        return len(self.tokens) - 1


def greedy_verify(candidates: Sequence[Sequence[int]], predicted: dict[int, int], pattern: StepPattern) -> Verdict:
    """Longest candidate prefix equal to the model's argmax, then the argmax after it.

    predicted: step index -> argmax token of its output (needs index 0 and every candidate token).
    """
    best, best_run = -1, 0
    for c, candidate in enumerate(candidates):
        run = 0
        while run < len(candidate) and candidate[run] == predicted[_source(pattern, c, run)]:
            run += 1
        if run > best_run:
            best, best_run = c, run
    tokens = list(candidates[best][:best_run]) if best >= 0 else []
    return Verdict(tokens + [predicted[_source(pattern, best, best_run)]], best)


def sample_verify(
    candidates: Sequence[Sequence[int]],
    prob_of: Callable[[int, int], float],
    pattern: StepPattern,
    uniform: Callable[[], float],
    draw: Callable[[int], int],
) -> Verdict:
    """Algorithm 4: accept a candidate token with its (residual) target probability, else try the next.

    prob_of(step_index, token) -> the target probability of token at that output. A rejected token is
    removed from the distribution and the rest renormalised before the next candidate is tried; when all
    are rejected the token is drawn from that residual: draw(step_index) -> a token from the target at
    that output without the tokens the candidates offer there (with none offered, the target itself).
    Candidates were made greedily by the lookahead branch, so (Appendix B) the output keeps the target
    distribution.
    """
    alive = list(range(len(candidates)))
    tokens: list[int] = []
    source = 0  # step index whose output predicts the next token
    depth = len(candidates[0]) if candidates else 0  # warm-up candidates are shorter than N - 1
    for position in range(depth):
        options = [candidates[c][position] for c in alive]
        chosen = _accept_one(options, source, prob_of, uniform)
        if chosen is None:
            return Verdict(tokens + [draw(source)], alive[0] if tokens else -1)
        token = options[chosen]
        tokens.append(token)
        alive = [c for c in alive if candidates[c][position] == token]
        source = pattern.candidate_index(alive[0], position + 1)
    return Verdict(tokens + [draw(source)], alive[0] if tokens else -1)


def _accept_one(tokens: Sequence[int], source: int, prob_of: Callable[[int, int], float],
                uniform: Callable[[], float]) -> int | None:
    """Algorithm 4 at one position: try `tokens` in turn, accepting one with its residual target probability;
    a rejected token leaves the distribution and the rest is renormalised. Returns the index of the accepted
    one, None when all were rejected (then the residual is the target without every one of `tokens`)."""
    rejected: list[int] = []
    rejected_mass = 0.0
    for i, token in enumerate(tokens):
        if token in rejected:
            continue  # already removed from the residual: probability 0
        p = prob_of(source, token)
        if uniform() * (1.0 - rejected_mass) < p:
            return i
        rejected.append(token)
        rejected_mass += p
    return None


def _source(pattern: StepPattern, candidate: int, run: int) -> int:
    """Step index whose output predicts token run + 1 of `candidate` (the input's when run is 0)."""
    return 0 if run == 0 else pattern.candidate_index(candidate, run)


def greedy_verify_tree(tree: DraftTree, predicted: dict[int, int], base: int) -> Verdict:
    """The longest path whose every token is the model's argmax at its parent, then the argmax after it.

    predicted: step index -> argmax (needs 0, the input token, and base + j for every node j).
    """
    node, source, tokens = ROOT, 0, []
    while True:
        want = predicted[source]
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return Verdict(tokens + [want], node)
        tokens.append(want)
        node, source = child, base + child


def sample_verify_tree(
    tree: DraftTree,
    prob_of: Callable[[int, int], float],
    base: int,
    uniform: Callable[[], float],
    draw: Callable[[int], int],
) -> Verdict:
    """Algorithm 4 at each node over its children: accept a child with its residual target probability, else
    remove its token and renormalise before the next; when all are rejected, draw from that residual and stop.
    The drafts do not depend on this step's random draws, so the output keeps the target distribution.

    prob_of(step_index, token) -> the target probability of token there; draw(step_index) -> a token from the
    target there without its children's tokens (a leaf: the target itself).
    """
    node, source, tokens = ROOT, 0, []
    while True:
        children = list(tree.children(node))
        chosen = _accept_one([tree.tokens[child] for child in children], source, prob_of, uniform)
        if chosen is None:
            return Verdict(tokens + [draw(source)], node)
        chosen = children[chosen]
        tokens.append(tree.tokens[chosen])
        node, source = chosen, base + chosen
