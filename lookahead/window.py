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
    def __init__(self, window: int, ngram: int, input_token: int, fill_tokens: Sequence[int], seed: int = 0) -> None:
        self.window, self.ngram = window, ngram
        self._fill = list(fill_tokens) or [input_token]
        self._rng = random.Random(seed)
        self.levels: list[list[int]] = [[input_token] + self._random(window - 1)]

    @property
    def full(self) -> bool:
        """Whether all N - 1 levels are filled (warm-up is over)."""
        return len(self.levels) == self.ngram - 1

    @property
    def tokens(self) -> list[int]:
        """The step's lookahead tokens in layout order: level 0 columns 0..W-1, then level 1, ..."""
        return [t for level in self.levels for t in level]

    def columns(self, outputs: Sequence[int]) -> list[list[int]]:
        """The n-grams closed by the last level's outputs: column i of every level plus outputs[i]."""
        return [[level[i] for level in self.levels] + [outputs[i]] for i in range(self.window)]

    def advance(self, outputs: Sequence[int], accepted: int, input_token: int) -> None:
        """Move to the next step after `accepted` tokens (>= 1) were added to the output.

        `outputs` are the model's W predictions at the last level; they become the newest level. Each
        level keeps guessing the same absolute positions, so its columns shift left by the positions
        the input advanced; the columns this uncovers at the right are filled from the prompt.
        """
        rows = self.levels + [list(outputs)]
        if self.full:
            rows = rows[1:]  # the oldest level leaves; the rest age by one level (one position)
            shift = accepted - 1
        else:
            shift = accepted
        self.levels = [row[shift:] + self._random(min(shift, self.window)) for row in rows]
        self.levels = [level[: self.window] for level in self.levels]
        self.levels[0][0] = input_token

    def _random(self, n: int) -> list[int]:
        return [self._rng.choice(self._fill) for _ in range(n)]
