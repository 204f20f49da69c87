"""The lookahead step layout and its attention pattern: the one source of truth.

A step feeds T tokens (see docs/DESIGN.md, "One decoding step"): the lookahead branch, then the
verification branch in one of two forms.

    step index            part                       relative position
    W*l + i               level l, column i          l + i       (l = 0..N-2, i = 0..W-1)
    W*(N-1) + c*(N-1)+k-1 chains: candidate c, token k    k      (c = 0..g-1, k = 1..N-1)
    W*(N-1) + j           tree: node j (pre-order)   depth of j  (j = 0..V-1)

Chains give T = (W + g)(N - 1); a tree, given by `tree_end[j]` (one past the pre-order index of the
last node of j's subtree), gives T = W(N - 1) + V. Chains are the tree in which each candidate is a
path. Level 0 column 0 is the input token. `visible(q, k)` below is the rule; the Triton kernel
(`attention_kernels.py`, `_visible`) writes the same comparisons line for line, and a test pins
the two together. `materialize()` builds a dense mask for the reference and tests only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


def check_tree_end(tree_end: Sequence[int], name: str = "tree_end") -> None:
    """ValueError unless tree_end describes a forest in pre-order: tree_end[j] in (j, V], subtrees nested.

    One pass (a tree is a new pattern every step, so this runs every step): a stack of the open subtrees' ends."""
    size = len(tree_end)
    open_ends: list[int] = []
    for j, end in enumerate(tree_end):
        if not j < end <= size:
            raise ValueError(f"{name}[{j}] must be in ({j}, {size}], got {end} (tree_end={list(tree_end)})")
        while open_ends and open_ends[-1] <= j:
            open_ends.pop()
        # laminar intervals: a node that starts inside i's subtree must also end inside it
        if open_ends and end > open_ends[-1]:
            raise ValueError(f"{name}[{j}] = {end} leaves its parent's subtree, which ends at {open_ends[-1]} "
                             f"(tree_end={list(tree_end)})")
        open_ends.append(end)


@dataclass(frozen=True)
class StepPattern:
    """One step's layout: window W, n-gram size N, and g candidates (chains) or a tree of draft nodes.

    `candidates` is g, what this step holds (the configured budget G is LookaheadConfig.guesses). With
    `tree_end` given the verification branch is that tree and `candidates` does not enter the layout
    (as the kernel contract ignores `guesses` in tree form).
    """

    window: int
    ngram: int
    candidates: int = 0
    tree_end: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, value, low in (("window", self.window, 1), ("ngram", self.ngram, 2),
                                 ("candidates", self.candidates, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.tree_end is not None:
            ends = self.tree_end.tolist() if isinstance(self.tree_end, torch.Tensor) else self.tree_end
            if isinstance(ends, (str, bytes)) or not isinstance(ends, Sequence):
                raise TypeError(f"tree_end must be a sequence of ints or None, got {type(self.tree_end).__name__}")
            exact = all(type(e) is int for e in ends)  # the common case, checked fast
            if not exact and any(isinstance(e, bool) or not isinstance(e, int) for e in ends):
                raise TypeError(f"tree_end must hold ints, got {list(ends)!r}")
            check_tree_end(ends)
            object.__setattr__(self, "tree_end", tuple(ends))

    @classmethod
    def of_tree(cls, window: int, ngram: int, tree_end: tuple[int, ...],
                depths: tuple[int, ...] | None = None) -> StepPattern:
        """A tree-form pattern whose `tree_end` (a tuple) is known to be a pre-order forest, as a `DraftTree`'s is by
        construction: not checked again. What the decode loop makes for every row of every step, where the check
        costs as much as the rest of the packing; anything else goes through the checking constructor. depths: each
        node's depth where the caller knows them (a grown draft tree does), the same as `_depths` would derive."""
        pattern = object.__new__(cls)
        for name, value in (("window", window), ("ngram", ngram), ("candidates", 0), ("tree_end", tree_end)):
            object.__setattr__(pattern, name, value)
        if depths is not None:
            object.__setattr__(pattern, "_depths", depths)  # (the cached property's value, given)
        return pattern

    @property
    def lookahead_len(self) -> int:
        """Tokens of the lookahead branch: W columns x (N - 1) levels."""
        return self.window * (self.ngram - 1)

    @property
    def is_tree(self) -> bool:
        return self.tree_end is not None

    @property
    def verify_len(self) -> int:
        """Tokens of the verification branch: g(N - 1) for chains, V for a tree."""
        return len(self.tree_end) if self.is_tree else self.candidates * (self.ngram - 1)

    @property
    def num_tokens(self) -> int:
        """T = W(N - 1) + g(N - 1) for chains, W(N - 1) + V for a tree."""
        return self.lookahead_len + self.verify_len

    @property
    def node_ends(self) -> tuple[int, ...]:
        """The verification branch as a tree: `tree_end`, or for chains each candidate a path of N - 1 nodes (node
        c(N - 1) + k - 1 ends where its candidate does). What a kernel that takes trees only reads."""
        if self.is_tree:
            return self.tree_end
        span = self.ngram - 1
        return tuple((j // span + 1) * span for j in range(self.candidates * span))

    @property
    def shape(self) -> tuple:
        """What a compiled step (a kernel plan, a CUDA graph) depends on: W, N, T, the form and, for chains, g. A
        tree's structure is left out: it changes every step and reaches the kernel as data (`tree_end`)."""
        return (self.window, self.ngram, self.num_tokens, self.is_tree, 0 if self.is_tree else self.candidates)

    @property
    def max_commit(self) -> int:
        """The most KV entries a verdict of this step commits: the input token plus the longest path."""
        if self.is_tree:
            return 1 + max(self._depths, default=0)
        return 1 + (self.ngram - 1) if self.candidates > 0 else 1

    def level_index(self, level: int, column: int) -> int:
        """Step index of level `level`, column `column` of the lookahead branch."""
        return self.window * level + column

    def candidate_index(self, candidate: int, token: int) -> int:
        """Step index of token `token` (1..N-1) of candidate `candidate` (chains form)."""
        if self.is_tree:
            raise ValueError("candidate_index is for the chains form; in tree form node j is at lookahead_len + j")
        return self.lookahead_len + candidate * (self.ngram - 1) + token - 1

    @cached_property
    def _depths(self) -> tuple[int, ...]:
        """Tree form: depth of each node = the nodes whose subtree holds it (itself included). One pass with a
        stack of the open subtrees' ends: a per-step tree is a new pattern, so this runs every step."""
        depths, open_ends = [], []
        for j, end in enumerate(self.tree_end or ()):
            while open_ends and open_ends[-1] <= j:
                open_ends.pop()
            open_ends.append(end)
            depths.append(len(open_ends))
        return tuple(depths)

    @cached_property
    def relative_positions(self) -> torch.Tensor:
        """[T] int64: the position of each step token relative to the input token."""
        idx = torch.arange(self.num_tokens)
        la = idx < self.lookahead_len
        level, column = idx // self.window, idx % self.window
        if self.is_tree:
            depth = torch.tensor((0,) * self.lookahead_len + self._depths, dtype=torch.int64)
        else:
            depth = (idx - self.lookahead_len) % (self.ngram - 1) + 1
        return torch.where(la, level + column, depth)

    @cached_property
    def position_list(self) -> tuple[int, ...]:
        """`relative_positions` as ints, made without torch: what a host packing a step every few milliseconds reads
        (building and converting a tensor costs more than the step's other host work per row)."""
        window = self.window
        branch = tuple(level + column for level in range(self.ngram - 1) for column in range(window))
        if self.is_tree:
            return branch + self._depths
        span = self.ngram - 1
        return branch + tuple(j % span + 1 for j in range(self.verify_len))

    def subtree_end(self, k_idx: torch.Tensor, tree_end: torch.Tensor | None = None) -> torch.Tensor:
        """One past the step index of the last token in verification token k_idx's subtree (chains: the end of its
        candidate). Only meaningful for k_idx >= lookahead_len; mirrors the tree load in the kernel (which reads chains
        as their tree).

        tree_end: tree form, an integer tensor [V] on k_idx's device that replaces the pattern's own (as the kernel
        takes the tree per call: a model keeps one program per shape and gets each step's tree as data).
        """
        W, N = self.window, self.ngram
        LA = W * (N - 1)
        if self.is_tree:
            if tree_end is None:
                tree_end = torch.tensor(self.tree_end, dtype=torch.int64, device=k_idx.device)
            ends = torch.cat([tree_end, tree_end.new_zeros(1)])  # one spare entry: V may be 0
            return LA + ends[(k_idx - LA).clamp(0, ends.shape[0] - 1)]
        return LA + ((k_idx - LA) // (N - 1) + 1) * (N - 1)

    def visible(self, q_idx: torch.Tensor, k_idx: torch.Tensor, tree_end: torch.Tensor | None = None) -> torch.Tensor:
        """Whether step token `q_idx` attends to step token `k_idx` (broadcasting int tensors); `tree_end` as in
        `subtree_end`."""
        return _visible_rule(q_idx, k_idx, self.subtree_end(k_idx, tree_end), self.window, self.ngram)

    def materialize(self, prefix_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense bool mask [T, prefix_len + T] (True = attend). For the reference and tests only."""
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
            raise ValueError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
        t = self.num_tokens
        idx = torch.arange(t, device=device)
        step = self.visible(idx[:, None], idx[None, :])
        prefix = torch.ones(t, prefix_len, dtype=torch.bool, device=device)
        return torch.cat([prefix, step], dim=1)


def _visible_rule(q_idx, k_idx, k_end, W: int, N: int):
    """The rule on step indices; `k_end` = subtree_end(k_idx). Line for line the kernel's `_visible`, where W and N
    are per-row run-time values."""
    LA = W * (N - 1)
    q_la = q_idx < LA
    k_la = k_idx < LA
    q_level = q_idx // W
    q_col = q_idx % W
    k_level = k_idx // W
    k_col = k_idx % W
    # lookahead: level 0 columns up to the query's, and the query's own column up to its level
    lookahead = q_la & k_la & (((k_level == 0) & (k_col <= q_col)) | ((k_col == q_col) & (k_level <= q_level)))
    # verification: the input token, and the nodes whose subtree holds the query (ancestors and itself)
    verify = (q_idx >= LA) & ((k_idx == 0) | ((k_idx >= LA) & (k_idx <= q_idx) & (q_idx < k_end)))
    return lookahead | verify


def lookahead_mask(window: int, ngram: int, guesses: int, prefix_len: int, *,
                   tree_end: Sequence[int] | None = None) -> torch.Tensor:
    """Bool [T, prefix_len + T] mask of one step (True = attend); the reference the kernel is held to.

    guesses: g, the candidates present (chains form; ignored when tree_end is given).
    """
    if tree_end is not None:
        return StepPattern(window, ngram, 0, tree_end).materialize(prefix_len)
    return StepPattern(window, ngram, guesses).materialize(prefix_len)
