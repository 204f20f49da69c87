"""`DraftTree`: the verification branch's draft tokens as a forest under the step's input token.

Nodes are in depth-first pre-order (a node before its descendants, a subtree contiguous), the order the
step feeds them in; `tree_end[j]` is one past the last node of j's subtree, which is all the attention
rule needs (docs/DESIGN.md, the step layout). Siblings hold distinct tokens (it is a trie), so a walk down
it picks at most one child per step. `preorder` is the one place that numbers a tree in pre-order: the
draft builders and lookahead parallelism's sub-steps all go through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import lookahead.host_loops as host_loops

ROOT = -1  # the parent of the input token's children


def preorder(children: Mapping[int, Sequence[int]], root: int) -> tuple[list[int], list[int]]:
    """The nodes under `root` (root excluded) in depth-first pre-order, children in the order given, and for each
    position one past the position of its subtree's last node."""
    order: list[int] = []
    ends: list[int] = []
    stack: list[tuple[int, int]] = [(child, -1) for child in reversed(children.get(root, ()))]
    while stack:
        node, opened = stack.pop()
        if opened >= 0:  # its subtree is done
            ends[opened] = len(order)
            continue
        stack.append((node, len(order)))
        order.append(node)
        ends.append(0)
        stack.extend((child, -1) for child in reversed(children.get(node, ())))
    return order, ends


@dataclass(frozen=True)
class DraftTree:
    """tokens, parents (ROOT for a child of the input token) and tree_end, all [V] in pre-order; `depths`, each node's
    depth (a child of the input token: 1), where the tree was grown (`grown`: the step's relative positions, which a
    pattern would otherwise derive from tree_end again), else None. Not part of a tree's equality: it follows from
    the rest."""

    tokens: list[int]
    parents: list[int]
    tree_end: list[int]
    depths: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def grown(cls, tokens: Sequence[int], parents: Sequence[int], compiled: bool = True) -> DraftTree:
        """A tree from nodes numbered in any order in which a parent comes before its children (ROOT: the input
        token); renumbered in pre-order, siblings in the order of their numbers. By the compiled loop where it builds
        (this runs for every row of every step), else `grown_python` (compiled=False: that one, for tests)."""
        module = host_loops.load() if compiled else None
        if module is None:
            return cls.grown_python(tokens, parents)
        return cls(*module.grown(tokens, parents))

    @classmethod
    def grown_python(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        # what `preorder` gives, by arithmetic instead of a walk (this runs for every row of every step): each node's
        # subtree size, then its place = the next free place under its parent (after the parent and its elder
        # siblings' subtrees), taken in number order
        n = len(parents)
        size = [1] * n
        for node in range(n - 1, -1, -1):
            parent = parents[node]
            if not ROOT <= parent < node:
                raise ValueError(f"parents[{node}] = {parent}: a parent must be ROOT or an earlier node")
            if parent != ROOT:
                size[parent] += size[node]
        place, free, root_free = [0] * n, [0] * n, 0
        for node, parent in enumerate(parents):
            if parent == ROOT:
                at, root_free = root_free, root_free + size[node]
            else:
                at = free[parent]
                free[parent] = at + size[node]
            place[node], free[node] = at, at + 1
        out_tokens, out_parents, ends, depth, depths = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
        for node, at in enumerate(place):
            parent = parents[node]
            out_tokens[at] = tokens[node]
            out_parents[at] = ROOT if parent == ROOT else place[parent]
            ends[at] = at + size[node]
            depth[node] = 1 if parent == ROOT else depth[parent] + 1
            depths[at] = depth[node]
        return cls(out_tokens, out_parents, ends, tuple(depths))

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """A tree from pre-order tokens and parent indices; ValueError unless the parents are a pre-order forest."""
        if len(tokens) != len(parents):
            raise ValueError(f"tokens and parents must have one entry per node, got {len(tokens)} and {len(parents)}")
        tree = cls.grown(tokens, parents)
        if tree.parents != list(parents):
            raise ValueError(f"parents={list(parents)} is not a pre-order forest (a node's parent must be an ancestor "
                             "of the node before it, or that node)")
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> Iterator[int]:
        """The children of `node` (ROOT: the input token) in order, by hopping over their subtrees."""
        child, end = (0, len(self.tokens)) if node == ROOT else (node + 1, self.tree_end[node])
        while child < end:
            yield child
            child = self.tree_end[child]

    def path(self, node: int) -> list[int]:
        """The nodes from a child of the input token down to `node` (empty for ROOT)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


EMPTY = DraftTree([], [], [])


@dataclass(frozen=True)
class BestFirst:
    """Draft nodes in the order a best-first growth took them: `tokens`, `parents` (indices into this order, ROOT for
    a child of the input token) and `scores`, each node's chance that a step accepts it, non-increasing. A parent
    comes before its children, so every prefix is a tree, the best of its size."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def tree(self, nodes: int | None = None) -> DraftTree:
        """The tree of the first `nodes` nodes (all: None) in pre-order, siblings best first (the order they were
        taken in)."""
        end = len(self.tokens) if nodes is None else nodes
        return DraftTree.grown(self.tokens[:end], self.parents[:end])
