"""`StepLayout`: how one lookahead step is packed for the model and read back. The one owner of that.

`StepPattern` (kernels) knows where each part of a step sits and who sees whom; this module decides
what goes there: the window's levels and the candidates' tokens in pattern order, which output rows
the loop reads, and which step indices a verdict commits. Nothing else re-derives them.

A step is either exact-size (the pattern of the levels and candidates present: W columns, `levels`
levels, g candidates) or static (always the configuration's full pattern (W, N, G), missing levels
and candidates filled with padding). Padding sits where no real token can see it (a missing level
above the real ones, a candidate slot past the real ones, the tail of a warm-up candidate), so every
real token's output is unchanged and the padding's outputs are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from lookahead.kernels import StepPattern

from .config import LookaheadConfig


def full_pattern(config: LookaheadConfig) -> StepPattern:
    """The configuration's full step: N - 1 levels and G candidates, T = (W + G)(N - 1) tokens."""
    return StepPattern(config.window, config.ngram, config.guesses)


@dataclass(frozen=True)
class StepLayout:
    """One packed step.

    pattern: what the model runs. tokens: [pattern.num_tokens] ids in pattern order. rows: the step
    indices whose logits the model returns, in order (a static step always has the same number).
    levels: the real lookahead levels (1..N-1); candidates: the real candidates, each `levels` or
    N - 1 tokens long (shorter during warm-up).
    """

    pattern: StepPattern
    tokens: list[int]
    rows: list[int]
    levels: int
    candidates: list[tuple[int, ...]]

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
        """Step indices of every real candidate token."""
        index = self.pattern.candidate_index
        return [index(c, k) for c, candidate in enumerate(self.candidates) for k in range(1, len(candidate) + 1)]

    def commit_indices(self, candidate: int, run: int) -> list[int]:
        """Step indices to keep after a verdict: the input token, then `run` tokens of `candidate`."""
        return [0] + [self.pattern.candidate_index(candidate, k) for k in range(1, run + 1)]


def pack_step(levels: Sequence[Sequence[int]], candidates: Sequence[tuple[int, ...]], full: StepPattern,
              static: bool) -> StepLayout:
    """Lay out the window's `levels` (level 0 first; its column 0 is the input token) and `candidates`.

    static: pad to `full` (the configuration's (W, N, G)); otherwise the exact pattern of what is present.
    """
    depth = len(levels)
    pattern = full if static else StepPattern(full.window, depth + 1, len(candidates))
    span = pattern.ngram - 1  # tokens per candidate slot
    pad = levels[0][0]  # any valid id will do: no real token sees a padding token
    tokens = [t for level in levels for t in level]
    tokens += [pad] * (pattern.lookahead_len - len(tokens))
    for candidate in candidates:
        tokens += [*candidate, *[pad] * (span - len(candidate))]
    tokens += [pad] * (pattern.num_tokens - len(tokens))
    last = pattern.level_index(depth - 1, 0)
    rows = [0, *range(last, last + pattern.window), *range(pattern.lookahead_len, pattern.num_tokens)]
    return StepLayout(pattern, tokens, rows, depth, list(candidates))
