"""`DraftTree`: the verification branch's draft tokens as a forest under the step's input token.

Nodes are in depth-first pre-order (a node before its descendants, a subtree contiguous), the order the
step feeds them in; `tree_end[j]` is one past the last node of j's subtree, which is all the attention
rule needs (docs/DESIGN.md, the tree form). Siblings hold distinct tokens (it is a trie), so a walk down
it picks at most one child per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

ROOT = -1  # the parent of the input token's children


@dataclass(frozen=True)
class DraftTree:
    """tokens, parents (ROOT for a child of the input token) and tree_end, all [V] in pre-order."""

    tokens: list[int]
    parents: list[int]
    tree_end: list[int]

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """A tree from pre-order tokens and parent indices; ValueError unless the parents are a pre-order forest."""
        if len(tokens) != len(parents):
            raise ValueError(f"tokens and parents must have one entry per node, got {len(tokens)} and {len(parents)}")
        ends = [j + 1 for j in range(len(parents))]
        path: list[int] = []  # ancestors of the node before j, itself included
        for j, parent in enumerate(parents):
            while path and path[-1] != parent:
                path.pop()
            if parent != ROOT and not path:
                raise ValueError(f"parents[{j}] = {parent} is not an ancestor of node {j - 1} or that node: "
                                 f"not a pre-order forest (parents={list(parents)})")
            for a in path:
                ends[a] = j + 1
            path.append(j)
        return cls(list(tokens), list(parents), ends)

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

    def depths(self) -> list[int]:
        """Depth of every node (a child of the input token has depth 1)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent == ROOT else depth[parent] + 1)
        return depth


EMPTY = DraftTree([], [], [])
