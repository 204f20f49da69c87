"""`StepLayout`: how one lookahead step is packed for the model and read back. The one owner of that.

`StepPattern` (kernels) knows where each part of a step sits and who sees whom; this module decides
what goes there: the window's levels and the drafts' tokens in pattern order, which output rows the
loop reads, and which step indices a verdict commits. Nothing else re-derives them.

The verification branch has two forms: chains (the paper's: g candidate n-grams of N - 1 tokens) and a
tree (a `DraftTree` of at most G(N - 1) nodes: the same tokens a step as chains, so settings compare
fairly). A step is either exact-size (the pattern of what is present: `levels` levels, g candidates or
V nodes) or static (always the configuration's full shape, missing levels, candidates and nodes filled
with padding). Padding sits where no real token can see it (a missing level above the real ones, a
candidate slot past the real ones, the tail of a warm-up candidate, leaf nodes after the real tree), so
every real token's output is unchanged and the padding's outputs are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from lookahead.kernels import StepPattern

from .config import LookaheadConfig
from .tree import ROOT, DraftTree


def full_pattern(config: LookaheadConfig) -> StepPattern:
    """The configuration's full step: N - 1 levels and G candidates, T = (W + G)(N - 1) tokens.

    Tree form: the same T with G(N - 1) nodes. Each step brings its own tree of that size, so this one stands
    for the shape only: it is a single path, the deepest tree the budget allows, so that `max_commit` is the
    most any step of the generation can commit.
    """
    if config.form == "tree":
        nodes = config.guesses * (config.ngram - 1)
        return StepPattern(config.window, config.ngram, tree_end=(nodes,) * nodes)
    return StepPattern(config.window, config.ngram, config.guesses)


@dataclass(frozen=True)
class StepLayout:
    """One packed step.

    pattern: what the model runs (tree form: with this step's tree). tokens: [pattern.num_tokens] ids in pattern
    order. rows: the step indices whose logits the model returns, in order (a static step always has the same
    number). levels: the real lookahead levels (1..N-1); candidates: chains form, the real candidates, each
    `levels` or N - 1 tokens long (shorter during warm-up); tree: tree form, the real nodes (padding excluded).
    topk: next tokens per step row the model returns beside the argmax (0: none).
    """

    pattern: StepPattern
    tokens: list[int]
    rows: list[int]
    levels: int
    candidates: list[tuple[int, ...]]
    tree: DraftTree | None = None
    topk: int = 0

    @cached_property
    def row_of(self) -> dict[int, int]:
        """Step index -> its row in the model's output (the first, where a step index is read twice)."""
        row_of: dict[int, int] = {}
        for r, index in enumerate(self.rows):
            row_of.setdefault(index, r)
        return row_of

    @property
    def last_level(self) -> range:
        """Step indices of the last real level, whose outputs close the lookahead n-grams."""
        start = self.pattern.level_index(self.levels - 1, 0)
        return range(start, start + self.pattern.window)

    @property
    def candidate_rows(self) -> list[int]:
        """Step indices of every real draft token (chains: candidate tokens; tree: nodes)."""
        if self.tree is not None:
            return list(range(self.pattern.lookahead_len, self.pattern.lookahead_len + len(self.tree)))
        index = self.pattern.candidate_index
        return [index(c, k) for c, candidate in enumerate(self.candidates) for k in range(1, len(candidate) + 1)]

    @property
    def real_indices(self) -> list[int]:
        """Step indices of every real token (the real levels, then the real drafts); padding is left out."""
        return [*range(self.pattern.window * self.levels), *self.candidate_rows]

    @cached_property
    def parents(self) -> list[int]:
        """[T] the step index of each step token's predecessor in its own context (-1 for the input token): level 0
        column i follows column i - 1, level l column i follows level l - 1 column i, a draft token its parent or
        the input token; padding follows the input token. The step is this tree: a token sees exactly its
        ancestors and itself (`StepPattern.visible`, pinned by tests), at relative position = its depth."""
        window, la = self.pattern.window, self.pattern.lookahead_len
        out = [-1, *range(window - 1), *range(la - window)]
        if self.tree is not None:
            out += [0 if parent == ROOT else la + parent for parent in self.tree.parents]
        else:
            span = self.pattern.ngram - 1
            for c in range(self.pattern.candidates):
                start = la + c * span
                out += [0, *range(start, start + span - 1)]
        out += [0] * (len(self.tokens) - len(out))  # padding nodes: children of the input token
        return out

    def predecessors(self, before: int) -> list[int]:
        """[T] the token before each step token in its own context (`before`: the one before the input token), by
        `parents`. Padding gets some token too; nothing reads its rows."""
        tokens = self.tokens
        return [before if p < 0 else tokens[p] for p in self.parents]

    def node_index(self, node: int) -> int:
        """Tree form: the step index of node `node` (ROOT: the input token, step index 0)."""
        return 0 if node == ROOT else self.pattern.lookahead_len + node

    def commit_indices(self, candidate: int, run: int) -> list[int]:
        """Step indices to keep after a verdict: the input token, then `run` accepted draft tokens.

        Chains: the first `run` tokens of candidate `candidate`. Tree: the path down to node `candidate`
        (ROOT when run is 0), whose depth is `run`.
        """
        if self.tree is not None:
            path = self.tree.path(candidate if run else ROOT)
            assert len(path) == run, (candidate, run, path)
            return [0] + [self.pattern.lookahead_len + node for node in path]
        return [0] + [self.pattern.candidate_index(candidate, k) for k in range(1, run + 1)]


def pack_step(levels: Sequence[Sequence[int]], drafts: Sequence[tuple[int, ...]] | DraftTree, full: StepPattern,
              static: bool, topk: int = 0) -> StepLayout:
    """Lay out the window's `levels` (level 0 first; its column 0 is the input token) and the drafts: candidate
    n-grams (chains form) or a `DraftTree` (tree form, `full` a tree pattern).

    static: pad to `full` (the configuration's shape); otherwise the exact pattern of what is present.
    """
    depth = len(levels)
    pad = levels[0][0]  # any valid id will do: no real token sees a padding token
    tokens = [t for level in levels for t in level]
    if isinstance(drafts, DraftTree):
        size = full.verify_len if static else len(drafts)
        if len(drafts) > size:
            raise ValueError(f"a tree of {len(drafts)} nodes does not fit the static step's {size}")
        # padding nodes are leaves after the real tree: their subtree is themselves, so no real node sees them
        tree_end = (*drafts.tree_end, *range(len(drafts) + 1, size + 1))
        pattern = StepPattern(full.window, full.ngram if static else depth + 1, tree_end=tree_end)
        tokens += [pad] * (pattern.lookahead_len - len(tokens))
        tokens += [*drafts.tokens, *[pad] * (size - len(drafts))]
        tree, candidates = drafts, []
    else:
        pattern = full if static else StepPattern(full.window, depth + 1, len(drafts))
        span = pattern.ngram - 1  # tokens per candidate slot
        tokens += [pad] * (pattern.lookahead_len - len(tokens))
        for candidate in drafts:
            tokens += [*candidate, *[pad] * (span - len(candidate))]
        tokens += [pad] * (pattern.num_tokens - len(tokens))
        tree, candidates = None, list(drafts)
    last = pattern.level_index(depth - 1, 0)
    rows = [0, *range(last, last + pattern.window), *range(pattern.lookahead_len, pattern.num_tokens)]
    return StepLayout(pattern, tokens, rows, depth, candidates, tree, topk)
