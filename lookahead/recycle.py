"""`RecycleTables`: the model's own next-token predictions, recorded at every row of every step, per token.

Token recycling: a step computes the model's top-k next tokens at all its rows (the lookahead levels, the
tree's nodes, the input token), right or wrong drafts alike; each row's list is kept under the row's token and
under the pair (the token before it in the row's context, its token), so a later step can draft from what the
model predicted after the same token(s) last time. The pair table is the sharper one (on the dev prompts its
first choice was the argmax about 3/4 of the time against 1/2 for the token table), the token table the
fallback for pairs never seen.

Both live on the host, not on the model's device: the next step's tree is built on the host before that step
is launched, so reading a device table would add a device-to-host sync per step, whereas the top-k of all
rows already arrive in the step's one device-to-host copy (with the argmax), so a host table costs no transfer
of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RecycleTables:
    """(previous token, token) -> top-k and token -> top-k, as dicts of lists: a step writes a few hundred rows with
    two `dict.update` calls, and the tree builder reads a list per node with no conversion."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.single: dict[int, list[int]] = {}

    def update(self, previous: Sequence[int], tokens: Sequence[int], topk: np.ndarray) -> None:
        """Rows of one step: their previous tokens [R], tokens [R] and top-k next tokens [R, k]; a later row wins
        over an earlier one with the same key."""
        rows = topk.tolist()
        self.pairs.update(zip(zip(previous, tokens, strict=True), rows, strict=True))
        self.single.update(zip(tokens, rows, strict=True))

    def lookup(self, previous: int, token: int) -> tuple[list[int] | None, Sequence[int]]:
        """(the pair's list or None, the token's list, empty if unknown)."""
        pair = self.pairs.get((previous, token))
        if pair is not None:
            return pair, ()
        return None, self.single.get(token, ())
