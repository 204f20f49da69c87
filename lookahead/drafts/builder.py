"""Draft sources merged into one token tree: what the verification branch of a tree-form step holds.

Three sources propose tokens under the step's input token and under every node of the tree:
  recycle  the model's own top-k next tokens recorded at every row of every step ("token recycling"), per
           (two previous tokens, token), else per (previous token, token), else per token;
  suffix   earlier occurrences of the sequence's last 1..4 tokens in prompt + output, and what followed them
           (continuations of any length up to the node budget), with how long the match runs back (up to 16);
  pool     the lookahead branch's n-grams (and the prompt's and output's, per `pool_from_*`), the most recent
           first.
Each offered edge (a token under a parent) is scored by `edges.EDGE_PROBABILITY`: the probability that it is the
model's argmax there given that its parent is accepted, from what each source says about it (its rank in the recycled
top-k, the match length behind a suffix continuation, ...). A node's score is the product down its path, the
chance that a step accepts it, so growing the tree best-first by score to the node budget maximises the
expected accepted tokens and splits the budget between the sources by what they are worth on this text.

With a drafting memory (`memory.py`, warm drafting) each source also proposes what earlier generations hold: the
memory's recycled list where the generation has no context entry of its own, suffix matches in earlier texts, the
memory's pool n-grams; each in states of its own (`edges.py`), so they rank below the generation's own evidence.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import lookahead.host_loops as host_loops

from .edges import (
    _S,
    EDGE_PROBABILITY,
    MATCH_BANDS,
    NO_RECYCLE,
    POOL_WEIGHTS,
    SUFFIX_WEIGHTS,
    pool_state,
    recycle_state,
    stronger,
    suffix_state,
)
from .memory import DraftMemory
from .pool import NGramPool
from .recycle import RecycleTables
from .suffix import SuffixIndex
from .tree import ROOT, BestFirst, DraftTree

RECYCLE_K = 8  # next tokens recorded per row
SUFFIX_MATCH = 4  # longest suffix looked up (indexed)
SUFFIX_REACH = MATCH_BANDS[-1]  # longest match measured: longer ones score as this long
SUFFIX_LIMIT = 4  # continuations taken from the suffix index per step


@dataclass(frozen=True)
class Sources:
    """Which sources draft (`LookaheadConfig`'s draft_pool, draft_suffix, draft_recycle): the n-gram pool, the suffix
    index, the recycled tables."""

    pool: bool = True
    suffix: bool = True
    recycle: bool = True


class DraftBuilder:
    """The tree form's draft policy: the draft sources of one generation, and the best-first tree builder."""

    compiled = True  # grow with the compiled loop where it builds (`host_loops`); False: the Python loop (tests)

    def __init__(self, sequence: Sequence[int], sources: Sources = Sources(), pool_limit: int = 0,
                 memory: DraftMemory | None = None) -> None:
        """memory: earlier generations' drafting state, read only (None: this generation's own only)."""
        self.use_pool, self.use_suffix, self.use_recycle = sources.pool, sources.suffix, sources.recycle
        self.pool_limit = pool_limit
        self.memory = memory
        self.suffix = SuffixIndex(SUFFIX_MATCH, SUFFIX_REACH)
        self.suffix.extend(sequence)
        self.recycle = RecycleTables()

    @property
    def topk(self) -> int:
        """Next tokens per row the model should return with a step (0: none needed)."""
        return RECYCLE_K if self.use_recycle else 0

    def extend(self, tokens: Sequence[int]) -> None:
        """Accepted tokens join the sequence the suffix source searches."""
        self.suffix.extend(tokens)

    def build(self, sequence: Sequence[int], pool: NGramPool, budget: int, levels: int = 0) -> DraftTree:
        """The tree of at most `budget` nodes under the input token `sequence[-1]`, best expected nodes first
        (`levels`, the window's, does not limit it: a tree's paths may be longer than N - 1)."""
        return self.grow(sequence, pool, budget).tree()

    def grow(self, sequence: Sequence[int], pool: NGramPool, budget: int) -> BestFirst:
        """Up to `budget` nodes under the input token `sequence[-1]` in best-first order, with their scores: any
        prefix of it is the best tree of its size."""
        if budget <= 0:
            return BestFirst([], [], [])
        # the paths proposed whole, as cursors at their first token (`_expand`); (list comprehensions: this runs for
        # every row every step)
        proposals: list = []
        memory = self.memory
        if self.use_suffix:
            states = _SUFFIX_STATES[0]
            proposals += [(continuation, 0, 1, *states[min(match, SUFFIX_REACH)])
                          for continuation, match in self.suffix.continuations(SUFFIX_LIMIT, budget)]
            if memory is not None:
                states = _SUFFIX_STATES[1]
                proposals += [(continuation, 0, 1, *states[min(match, SUFFIX_REACH)]) for continuation, match
                              in memory.continuations(sequence[-SUFFIX_REACH:], SUFFIX_LIMIT, budget)]
        if self.use_pool:
            own, held = _POOL_STATES
            proposals += [(continuation, 0, 2, *own) for continuation in pool.candidates(sequence[-1], self.pool_limit)]
            if memory is not None:
                proposals += [(continuation, 0, 2, *held)
                              for continuation in memory.candidates(sequence[-1], self.pool_limit)]
        previous = sequence[-2] if len(sequence) > 1 else -1
        second = sequence[-3] if len(sequence) > 2 else -1
        return self._grow(second, previous, sequence[-1], proposals, budget)

    def _grow(self, second: int, previous: int, root_token: int, proposals: list, budget: int) -> BestFirst:
        """Best-first growth (`_grow_python`), by the compiled loop where it builds: the same nodes, bit for bit."""
        module = _compiled() if self.compiled else None
        if module is None:
            return self._grow_python(second, previous, root_token, proposals, budget)
        recycle, memory = self.recycle, self.memory
        own = (recycle.triples, recycle.pairs, recycle.single) if self.use_recycle else None
        held = None if memory is None else (memory.recycle.triples, memory.recycle.pairs, memory.recycle.single)
        return BestFirst(*module.grow(second, previous, root_token, proposals, budget, own, held))

    def _grow_python(self, second: int, previous: int, root_token: int, proposals: list, budget: int) -> BestFirst:
        """Best-first growth. Children of a node are sorted by edge probability, so a child is offered only
        when its elder sibling is taken: two heap pushes per node instead of one per candidate. The proposals'
        trie is unfolded one level at a time, under the nodes taken (`_expand`): a suffix continuation may run to
        the node budget, and most of its tokens are never reached.

        This loop runs for every node of every row's draft every step (the engine's largest host cost), so the
        common node, one with recycled children only, is handled inline (`_children` does the same, slower)."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap: list = []
        offered = self._children(second, previous, root_token, _expand(proposals))
        if offered:
            heap.append((-offered[0][0], 0, ROOT, root_token, previous, 1.0, offered, 0))
        order = 1
        lookup = self.recycle.lookup if self.use_recycle else None
        memory = self.memory
        pop, push, ranked = heapq.heappop, heapq.heappush, _RANKED_PROBABILITY
        while heap and len(tokens) < budget:
            neg, _, parent, parent_token, grand_token, parent_score, siblings, i = pop(heap)
            _, token, below = siblings[i]
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg)
            if i + 1 < len(siblings):
                push(heap, (-parent_score * siblings[i + 1][0], order, parent, parent_token, grand_token, parent_score,
                            siblings, i + 1))
                order += 1
            if below or lookup is None:
                offered = self._children(grand_token, parent_token, token, _expand(below) if below else None)
            else:  # `_children` without proposals, `_recycled` inline
                listed, single = lookup(grand_token, parent_token, token)
                if listed is not None:
                    kind = 0
                elif single or memory is None:
                    listed, kind = single, 1
                else:
                    listed, single = memory.recycled(grand_token, parent_token, token)
                    listed, kind = (listed, 2) if listed is not None else (single, 3)
                offered = list(zip(ranked[kind], listed, _NONE, strict=False))
                offered.sort(reverse=True)
            if offered:
                push(heap, (neg * offered[0][0], order, node, token, parent_token, -neg, offered, 0))
                order += 1
        return BestFirst(tokens, parents, scores)

    def _children(self, second: int, previous: int, token: int, proposed: dict | None) -> list:
        """(probability, child token, proposals below it) of every child offered under `token` (whose own previous
        tokens are `second`, `previous`), best first."""
        listed, kind = self._recycled(second, previous, token) if self.use_recycle else ((), 1)
        if not proposed:  # most nodes: recycled tokens only, their probabilities tabulated by rank
            out = list(zip(_RANKED_PROBABILITY[kind], listed, _NONE, strict=False))  # listed: <= k
        else:  # each child's state code (its recycled rank's, plus what proposes it) and the proposals below it
            codes = dict(zip(listed, _RANKED[kind], strict=False))
            missing = _MISSING[kind] if listed else NO_RECYCLE
            below_of = {}
            for child, (below, suffix, pool) in proposed.items():
                code = codes.get(child)
                codes[child] = (missing if code is None else code) + suffix + pool
                below_of[child] = below
            out = [(EDGE_PROBABILITY[code], child, below_of.get(child)) for child, code in codes.items()]
        out.sort(reverse=True)  # siblings are distinct tokens: ties stop at the token
        return out

    def _recycled(self, second: int, previous: int, token: int) -> tuple[Sequence[int], int]:
        """The recycled list under `token` and its kind (an index of `_RANKED`): this generation's (its longest
        context seen, else the token's own list), else the memory's (the same). Taking the memory's context list
        before this generation's token list measured no higher S and costs a look-up more."""
        context, single = self.recycle.lookup(second, previous, token)
        if context is not None:
            return context, 0
        if single or self.memory is None:
            return single, 1
        remembered, remembered_single = self.memory.recycled(second, previous, token)
        return (remembered, 2) if remembered is not None else (remembered_single, 3)


# the states of ranks 0..k-1 in a context's recycled list and in a token's (own, then the memory's), their
# probabilities, and the state of a token absent from the list
_KINDS = ((True, False), (False, False), (True, True), (False, True))
_RANKED = [[recycle_state(context, rank, memory) for rank in range(RECYCLE_K)] for context, memory in _KINDS]
_RANKED_PROBABILITY = [[EDGE_PROBABILITY[state] for state in states] for states in _RANKED]
_MISSING = [recycle_state(context, None, memory) for context, memory in _KINDS]
_NONE = [None] * RECYCLE_K
# a proposal's (first token's, later tokens') states: a suffix continuation's by its match length (longer ones score as
# SUFFIX_REACH: the last band), a pool n-gram's; the generation's own, then the memory's
_SUFFIX_STATES = [[(suffix_state(match, False, memory), suffix_state(match, True, memory))
                   for match in range(SUFFIX_REACH + 1)] for memory in (False, True)]
_POOL_STATES = [(pool_state(False, memory), pool_state(True, memory)) for memory in (False, True)]


_configured = False


def _compiled():
    """The compiled loop with this module's edge tables (None where it does not build)."""
    global _configured
    module = host_loops.load()
    if module is not None and not _configured:
        module.configure(EDGE_PROBABILITY, _RANKED, _MISSING, NO_RECYCLE, SUFFIX_WEIGHTS, POOL_WEIGHTS, _S)
        _configured = True
    return module


def _expand(cursors: list) -> dict:
    """One level of the proposal trie: cursors (path, index, slot, first state, later state), each at a token of a
    proposed path, grouped by that token -> [the cursors one token further on, suffix state, pool state], keeping
    the stronger state where proposals share a node (in the order proposed, as inserting them whole would)."""
    level: dict = {}
    for cursor in cursors:
        path, i, slot, first, later = cursor
        token, state = path[i], first if i == 0 else later
        entry = level.get(token)
        if entry is None:
            entry = level[token] = [[], 0, 0]
            entry[slot] = state
        elif stronger(slot, state, entry[slot]):
            entry[slot] = state
        if i + 1 < len(path):
            entry[0].append((path, i + 1, slot, first, later))
    return level
