"""`StepLayout`: how one lookahead step is packed for the model and read back. The one owner of that, and of the
numberings of a step's tokens.

`StepPattern` (kernels) knows where each part of a step sits and who sees whom; this module decides what goes
there: the window's levels and the draft tree's tokens in pattern order, which output rows the loop reads, and
which step indices a verdict commits. A token of a step has four numbers, and only this module translates them:

    step index   its place in the step's T tokens (the pattern's order; the KV entry it writes is L + index)
    output row   its place in the rows the model returns (`rows`): the input token, the last level, every node
    slot         its place among the verified tokens: 0 the input token, 1 + j tree node j (what verification reads)
    node         its place in the draft tree (pre-order), ROOT for the input token

A step is either exact-size (the pattern of what is present: `levels` levels, V nodes) or static (always the
configuration's full shape, missing levels and nodes filled with padding). Padding sits where no real token can
see it (a missing level above the real ones, leaf nodes after the real tree), so every real token's output is
unchanged and the padding's outputs are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

from lookahead.config import LookaheadConfig
from lookahead.drafts import ROOT, DraftTree
from lookahead.kernels import StepPattern

from .verify import Verdict


@lru_cache(maxsize=256)  # a self-tuned row asks for its bucket's shape every step: make each once
def full_pattern(config: LookaheadConfig, nodes: int | None = None) -> StepPattern:
    """The configuration's full step: N - 1 levels and a tree of G(N - 1) nodes (or `nodes`: a self-tuned bucket's
    shape), T = W(N - 1) + nodes tokens.

    Each step brings its own tree of that size, so this one stands for the shape only, as the deepest tree the
    form's drafts can be, so that `max_commit` is the most any step of the generation commits: for the tree form a
    single path of all its nodes, for chains G paths of N - 1 (the paper's candidates)."""
    nodes, span = config.tree_nodes if nodes is None else nodes, config.ngram - 1
    if config.form == "chains":
        return StepPattern(config.window, config.ngram, tree_end=tuple((j // span + 1) * span for j in range(nodes)))
    return StepPattern(config.window, config.ngram, tree_end=(nodes,) * nodes)


@dataclass(frozen=True)
class StepLayout:
    """One packed step.

    pattern: what the model runs, with this step's tree. tokens: [pattern.num_tokens] ids in pattern order. rows:
    the step indices whose logits the model returns, in order (a static step always has the same number). levels:
    the real lookahead levels (1..N-1); tree: the real draft nodes (padding excluded). topk: next tokens per step
    row the model returns beside the argmax (0: none). branch: whether the step runs the lookahead branch (a
    self-tuned plain step does not: its one level is the input token, and the window waits).
    """

    pattern: StepPattern
    tokens: list[int]
    rows: list[int]
    levels: int
    tree: DraftTree
    topk: int = 0
    branch: bool = True

    @cached_property
    def row_of(self) -> dict[int, int]:
        """Step index -> its output row (the first, where a step index is read twice)."""
        row_of: dict[int, int] = {}
        for r, index in enumerate(self.rows):
            row_of.setdefault(index, r)
        return row_of

    @property
    def first_draft_row(self) -> int:
        """The output row of node 0: `rows` is the input token, the last level's W columns, then one row per node
        (padding included)."""
        return 1 + self.pattern.window

    @property
    def last_level_rows(self) -> range:
        """The output rows of the last real level, whose outputs close the lookahead n-grams."""
        return range(1, 1 + self.pattern.window)

    @property
    def slot_rows(self) -> list[int]:
        """The output row of each verified slot of the real tree: [0, first_draft_row + j for each node j]."""
        first = self.first_draft_row
        return [0, *range(first, first + len(self.tree))]

    @property
    def num_slots(self) -> int:
        """Verified slots of the step's pattern, padding included: the input token and every node."""
        return 1 + self.pattern.verify_len

    def index_of_node(self, node: int) -> int:
        """The step index of tree node `node` (ROOT: the input token, step index 0)."""
        return 0 if node == ROOT else self.pattern.lookahead_len + node

    def index_of_slot(self, slot: int) -> int:
        """The step index of verified slot `slot`."""
        return self.index_of_node(slot - 1 if slot else ROOT)

    def slot_of_index(self, index: int) -> int:
        """The verified slot of step index `index` (the input token or a node)."""
        return 0 if index == 0 else 1 + index - self.pattern.lookahead_len

    @property
    def node_indices(self) -> range:
        """Step indices of every real tree node."""
        start = self.pattern.lookahead_len
        return range(start, start + len(self.tree))

    @property
    def real_indices(self) -> list[int]:
        """Step indices of every real token (the real levels, then the real nodes); padding is left out."""
        return [*range(self.pattern.window * self.levels), *self.node_indices]

    @cached_property
    def parents(self) -> list[int]:
        """[T] the step index of each step token's predecessor in its own context (-1 for the input token): level 0
        column i follows column i - 1, level l column i follows level l - 1 column i, a node its parent (or the
        input token); padding follows the input token. The step is this tree: a token sees exactly its ancestors
        and itself (`StepPattern.visible`, pinned by tests), at relative position = its depth."""
        window, la = self.pattern.window, self.pattern.lookahead_len
        out = [-1, *range(window - 1), *range(la - window)]
        out += [0 if parent == ROOT else la + parent for parent in self.tree.parents]  # `index_of_node`, inline
        out += [0] * (len(self.tokens) - len(out))  # padding nodes: children of the input token
        return out

    @cached_property
    def row_depths(self) -> list[int]:
        """[R] the relative position of each output row's token (its next token takes absolute position L + depth + 1,
        L the input token's): what sampling keys its draws by."""
        depths = self.pattern.position_list
        return [depths[i] for i in self.rows]

    def commit_indices(self, verdict: Verdict) -> list[int]:
        """Step indices to keep after a verdict: the input token, then the path down to its last accepted node."""
        la, parents, node, up = self.pattern.lookahead_len, self.tree.parents, verdict.node, []
        while node != ROOT:  # `tree.path`, inline, and `index_of_node` of each (none is ROOT)
            up.append(la + node)
            node = parents[node]
        up.append(0)
        return up[::-1]


def pack_step(levels: Sequence[Sequence[int]], tree: DraftTree, full: StepPattern, static: bool,
              topk: int = 0, branch: bool = True) -> StepLayout:
    """Lay out the window's `levels` (level 0 first; its column 0 is the input token) and the draft `tree`.

    static: pad to `full` (the configuration's shape, or a bucket's); otherwise the exact pattern of what is present.
    branch False: without the lookahead branch, exact size: the input token and the tree (with no tree, a plain
    step: `full` is then plain decoding's pattern, one token, one output row).
    """
    if not branch:
        if not len(tree):
            if full.num_tokens != 1:
                raise ValueError(f"a step of the input token alone is a plain step, not {full.num_tokens} tokens")
            return StepLayout(full, [levels[0][0]], [0], 1, tree, topk, branch)
        levels, window, static = [levels[0][:1]], 1, False
    else:
        window = full.window
    depth = len(levels)
    pad = levels[0][0]  # any valid id will do: no real token sees a padding token
    size = full.verify_len if static else len(tree)
    if len(tree) > size:
        raise ValueError(f"a tree of {len(tree)} nodes does not fit the static step's {size}")
    # padding nodes are leaves after the real tree: their subtree is themselves, so no real node sees them
    tree_end = (*tree.tree_end, *range(len(tree) + 1, size + 1))
    # a draft tree is a pre-order forest by construction (`DraftTree.grown`): the pattern skips checking it again,
    # and takes a grown tree's depths (padding nodes are children of the input token)
    depths = None if tree.depths is None else (*tree.depths, *(1,) * (size - len(tree)))
    pattern = StepPattern.of_tree(window, full.ngram if static else depth + 1, tree_end, depths)
    tokens = [t for level in levels for t in level]
    tokens += [pad] * (pattern.lookahead_len - len(tokens))
    tokens += [*tree.tokens, *[pad] * (size - len(tree))]
    last = pattern.level_index(depth - 1, 0)
    rows = [0, *range(last, last + pattern.window), *range(pattern.lookahead_len, pattern.num_tokens)]
    return StepLayout(pattern, tokens, rows, depth, tree, topk, branch)
