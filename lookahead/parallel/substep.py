"""A step divided among K ranks (lookahead parallelism, the paper's §3.4): each rank's sub-step.

The whole step is one `StepLayout`; this module only cuts it. Read as a tree (`StepLayout.parents`: a token
sees exactly its ancestors and itself, at relative position = its depth), a step is the level-0 chain from
the input token, each lookahead column hanging off its level-0 token, and the verification branches (chains'
candidates, a tree's subtrees) hanging off the input token. The units of work are the columns and those
branches: each unit goes to one rank, which reports the outputs of its tokens (it owns them). A rank's
sub-step is its units plus their ancestors, the input token and the level-0 tokens its columns read, which
several ranks compute and one owns. Restricted to those tokens the step's visibility is still "ancestors
and itself", so a sub-step is a tree-form `StepPattern(1, 2, tree_end)` (the input token, then its
pre-order subtree): no kernel or mask change, and no communication inside the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lookahead.drafts import preorder
from lookahead.kernels import StepPattern
from lookahead.loop import StepLayout


@dataclass(frozen=True)
class SubStep:
    """One rank's share of a step.

    indices: the step index of each sub-step token (pre-order, the input token first).
    pattern: the tree pattern the rank's model runs, with `size` tokens (padding leaves past the real ones).
    tokens: [size] token ids in pattern order. owned: the step indices whose outputs this rank reports.
    """

    indices: tuple[int, ...]
    pattern: StepPattern
    tokens: tuple[int, ...]
    owned: tuple[int, ...]

    @cached_property
    def local(self) -> dict[int, int]:
        """Step index -> its index in the sub-step."""
        return {index: j for j, index in enumerate(self.indices)}


@dataclass(frozen=True)
class StepSplit:
    """Who owns which step index (`owner[i]`: a rank) and every rank's owned indices, ascending."""

    owner: tuple[int, ...]
    owned: tuple[tuple[int, ...], ...]

    def sub_step(self, layout: StepLayout, rank: int, size: int = 0) -> SubStep:
        """Rank `rank`'s sub-step: its owned tokens and their ancestors in pre-order, padded with leaves to `size`
        tokens when that is more."""
        parents = layout.parents
        keep = set()
        for index in self.owned[rank]:
            while index >= 0 and index not in keep:
                keep.add(index)
                index = parents[index]
        children: dict[int, list[int]] = {}
        for index in sorted(keep):
            if index:
                children.setdefault(parents[index], []).append(index)
        order, ends = preorder(children, 0)  # the input token's subtree; the input token itself goes first
        real = 1 + len(order)
        # pattern nodes are the tokens after the root, the input token: its subtree, then padding leaves
        total = max(size, real)
        tree_end = ends + list(range(real, total))
        tokens = [layout.tokens[0], *(layout.tokens[i] for i in order)]
        tokens += [layout.tokens[0]] * (total - real)
        pattern = StepPattern(1, 2, tree_end=tuple(tree_end))
        return SubStep((0, *order), pattern, tuple(tokens), self.owned[rank])


def split_step(layout: StepLayout, ranks: int) -> StepSplit:
    """Divide `layout`'s real tokens among `ranks` ranks.

    Columns go in contiguous blocks, the last block to the last rank (a column needs the level-0 tokens left of
    it, so the low ranks compute fewer of them); then the verification branches, largest first, each to the
    rank whose sub-step is smallest so far (ties: the lower rank). Every rank computes the same split.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    window, levels = layout.pattern.window, layout.levels
    parents = layout.parents
    real = layout.real_indices
    owner = [-1] * len(layout.tokens)
    loads = [0] * ranks
    for rank in range(ranks):
        first, last = rank * window // ranks, (rank + 1) * window // ranks
        for column in range(first, last):
            for level in range(levels):
                owner[window * level + column] = rank
        if last > first:  # level 0 up to its last column, the upper levels of its own
            loads[rank] = last + (levels - 1) * (last - first)
        else:
            loads[rank] = 1  # the input token
    branches: dict[int, list[int]] = {}
    la = layout.pattern.lookahead_len
    for index in real:
        if index >= la:
            root = index
            while parents[root] != 0:
                root = parents[root]
            branches.setdefault(root, []).append(index)
    for root in sorted(branches, key=lambda r: (-len(branches[r]), r)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        for index in branches[root]:
            owner[index] = rank
        loads[rank] += len(branches[root])
    owned = tuple(tuple(i for i in real if owner[i] == rank) for rank in range(ranks))
    return StepSplit(tuple(owner), owned)
