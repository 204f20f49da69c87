"""The 2D lookahead window: N - 1 levels of W tokens along the Jacobi trajectory.

Level l, column i holds a guess for the token at relative position l + i (level 0 column 0 is the
input token). Column i read bottom-up is an (N-1)-gram; the model's output at its top closes an
N-gram for the pool. Warm-up (as in the authors' code): the window starts with level 0 only, drawn
from the prompt, and gains one level per step until it has N - 1; until then steps use the pattern
of a smaller N.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class LookaheadWindow:
    """The window's levels (`levels[l][i]`), their step tokens, the n-grams they close, and their update."""

    def __init__(self, window: int, ngram: int, input_token: int, fill_tokens: Sequence[int], seed: int = 0) -> None:
        self.window, self.ngram = window, ngram
        self._fill = list(fill_tokens) or [input_token]
        self._rng = random.Random(seed)
        self.levels: list[list[int]] = [[input_token] + self._random(window - 1)]

    @property
    def full(self) -> bool:
        """Whether all N - 1 levels are filled (warm-up is over)."""
        return len(self.levels) == self.ngram - 1

    def columns(self, outputs: Sequence[int]) -> list[list[int]]:
        """The n-grams closed by the last level's outputs: column i of every level plus outputs[i]."""
        return [[level[i] for level in self.levels] + [outputs[i]] for i in range(self.window)]

    def advance(self, outputs: Sequence[int], input_token: int) -> None:
        """Move the trajectory one Jacobi iteration on: `outputs` (the last level's W predictions) become
        the newest level and, once the window is full, the oldest level leaves.

        The window moves one level per step however many tokens the step accepted (the authors'
        ALWAYS_FWD_ONE): every column keeps an unbroken trajectory, whose n-grams stay consistent even
        when their positions drift. Shifting columns by the accepted count instead discards trajectories
        at the right edge and measured lower S on the dev prompts (chains form, W=5, N=4, G=5).
        """
        rows = self.levels + [list(outputs)]
        if self.full:
            self.levels = rows[1:]
        else:
            # warm-up: levels keep their ages and guess the same positions, one column further left
            self.levels = [row[1:] + self._random(1) for row in rows]
        self.levels[0][0] = input_token

    def hold(self, input_token: int) -> None:
        """A step ran without the lookahead branch (a plain step of a self-tuned generation): the trajectory waits,
        and the new input token takes level 0, column 0."""
        self.levels[0][0] = input_token

    def _random(self, n: int) -> list[int]:
        return [self._rng.choice(self._fill) for _ in range(n)]
